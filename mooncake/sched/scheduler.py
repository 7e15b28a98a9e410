"""Mooncake's conductor policy: pick a prefill/decode pair per request, or reject early.

For each prefill instance the estimated TTFT is its queue wait + the time to
fetch the prefix blocks it lacks from the stores + the prefill time of the
tokens still uncached. The decode instance is chosen by the batch it is
expected to run when this request's prefill finishes. With SLOs set, a request
no pair is predicted to serve in time is refused now, before any compute.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from mooncake.config import ConductorConfig
from mooncake.protocol import FetchPlan
from mooncake.sched.cluster import Cluster, Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex


@dataclass
class Plan:
    prefill: Node
    decode: Node
    fetch: list[FetchPlan]
    device_blocks: int  # prefix blocks already in the prefill instance's device cache
    reusable_blocks: int  # prefix blocks reusable in all (device + stores)
    est_ttft_s: float
    est_prefill_s: float
    fetch_hashes: list[bytes] = field(default_factory=list)


@dataclass
class Rejection:
    status: int  # 429 or 503
    reason: str  # metric label: ttft_slo, tbt_slo, no_workers, overloaded
    message: str
    retry_after_s: float


class Scheduler:
    def __init__(self, cfg: ConductorConfig, cluster: Cluster, index: KVIndex,
                 prefill_cost: PrefillCostModel, decode_cost: DecodeCostModel) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.index = index
        self.prefill_cost = prefill_cost
        self.decode_cost = decode_cost
        self._rr = itertools.count()

    def plan(self, hashes: Sequence[bytes], n_tokens: int, max_tokens: int, block_tokens: int,
             now: float, waiting: int = 0) -> Plan | Rejection:
        prefills = self.cluster.of_role("prefill")
        decodes = self.cluster.of_role("decode")
        if not prefills or not decodes:
            return Rejection(503, "no_workers", "no prefill or decode instance is available", 1.0)
        if waiting >= self.cfg.max_waiting:
            return Rejection(503, "overloaded", f"{waiting} requests are queued; try again later", 1.0)

        stores = {n.node_id: n for n in self.cluster.of_role("store")} if self.cfg.use_store else {}
        # Blocks must leave at least one prompt token to compute (it yields the logits).
        usable = min(len(hashes), (n_tokens - 1) // block_tokens)
        # One walk: each node's leading run, and how far the stores together cover the chain.
        runs, store_end = self.index.prefix_runs(hashes[:usable], stores)
        fetch_s = self.prefill_cost.fetch_block_s
        prefill_time: dict[int, float] = {}  # by reusable blocks: most instances share one value

        candidates = []
        for p in prefills:
            dev = min(runs.get(p.node_id, 0), usable)
            reusable = max(dev, store_end)
            prefill_s = prefill_time.get(reusable)
            if prefill_s is None:
                cached = reusable * block_tokens
                prefill_s = prefill_time[reusable] = self.prefill_cost.predict(n_tokens - cached, cached)
            est = p.queue_s + (reusable - dev) * fetch_s + prefill_s
            candidates.append((est, prefill_s, dev, reusable, p))

        if self.cfg.policy == "round_robin":
            chosen = candidates[next(self._rr) % len(candidates)]
        elif self.cfg.policy == "least_loaded":
            chosen = min(candidates, key=lambda c: (c[4].queue_s, len(c[4].work)))
        else:
            chosen = min(candidates, key=lambda c: c[0])
        est, prefill_s, dev, reusable, p = chosen

        if self.cfg.ttft_slo_ms and est * 1000 > self.cfg.ttft_slo_ms:
            best = min(c[0] for c in candidates)
            if best * 1000 > self.cfg.ttft_slo_ms:
                return Rejection(429, "ttft_slo",
                                 f"predicted time to first token {best * 1000:.0f} ms exceeds the "
                                 f"{self.cfg.ttft_slo_ms:.0f} ms SLO", retry_after_s=max(1.0, best))

        first_token_at = now + est
        best_d, best_batch = None, None
        for d in decodes:
            batch = d.running_at(first_token_at) + 1
            if best_batch is None or batch < best_batch:
                best_d, best_batch = d, batch
        assert best_d is not None and best_batch is not None
        tbt = self.decode_cost.predict(best_batch)
        if self.cfg.tbt_slo_ms and tbt * 1000 > self.cfg.tbt_slo_ms:
            return Rejection(429, "tbt_slo",
                             f"predicted time between tokens {tbt * 1000:.0f} ms at batch {best_batch} "
                             f"exceeds the {self.cfg.tbt_slo_ms:.0f} ms SLO", retry_after_s=1.0)

        segs: list[tuple[int, int, str]] = []
        if reusable > dev:  # read from the stores local to the chosen instance first
            local = [s.node_id for s in stores.values() if s.name == p.name]
            segs = self.index.covering_run(hashes[:reusable], dev, set(stores), local)
        fetch = [FetchPlan(s, e, stores[node].endpoints["store"]) for s, e, node in segs]
        return Plan(p, best_d, fetch, dev, reusable, est, prefill_s,
                    fetch_hashes=[bytes(h) for h in hashes[dev:reusable]])

    def expected_end(self, now: float, est_ttft_s: float, max_tokens: int, batch: int) -> float:
        return now + est_ttft_s + max_tokens * self.decode_cost.predict(batch)
