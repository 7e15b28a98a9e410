"""Which of a request's blocks go to the store (issue 33), with ``[conductor] store_writes =
"reused"``. A block goes to the store once its prefix recurs: it was in an earlier prompt
(``sightings.py``). A prompt that is mostly a recurring prefix (at least half of it: a
conversation or an agent going on) is written whole, and its decode writes the blocks it
completes, as the next turn will start with them; so is a session's. A prompt that is mostly new
after a recurring prefix (a fresh document after a shared system prompt) has only the recurring
part written. A prompt new from its first block is written whole while the workload reuses (at
least ``WRITE_NEW_CHAINS_AT`` of recent requests start with a recurring prefix: the next turn of
a conversation may land on another instance), and stays in the prefill's device cache alone
otherwise: a workload with no reuse writes nothing. A prefix left unwritten that recurs is
written from the first block the store lacks, from the device cache of the prefill that holds it.
A fork of a request (``n`` > 1) or a retry writes no prompt blocks (its first attempt decided).
``"all"`` writes every block a prefill computes and every block a decode completes."""

from __future__ import annotations

from typing import Sequence

from mooncake.metrics import Metrics
from mooncake.sched.node_registry import Cluster
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.plan import Plan
from mooncake.sched.sightings import Sightings

REUSE_ALPHA = 1 / 64  # weight of each request in ``WriteAdmission.reuse``
WRITE_NEW_CHAINS_AT = 0.01  # from this share of recurring requests on, a new chain is written at once


class WriteAdmission:
    def __init__(self, policy: str, cluster: Cluster, index: KVIndex) -> None:
        self.policy = policy
        self.cluster = cluster
        self.index = index
        self.sightings = Sightings()
        # the leading blocks of prompts left (partly) unwritten: one hash a prompt, 32 bits each
        self.unwritten = Sightings(per_generation=1 << 17, log2_bits=22)
        self.reuse = 0.0  # the share of recent requests whose prompt starts with a recurring prefix

    def admit(self, plan: Plan, hashes: Sequence[bytes], session: bool, first: bool, metrics: Metrics) -> None:
        """Set ``plan.store_range`` (blocks ``[lo, hi)`` of the chain to write) and whether its
        decode writes the blocks it completes (``decode_writes``); ``first``: the request's first
        attempt (only it is sighted and writes its prompt). Counted in
        ``mooncake:store_write_blocks_total{decision}``."""
        if self.policy == "all" or not plan.store_endpoint or not hashes:
            return
        if not first:
            plan.store_range, plan.decode_writes = (0, 0), session
            return
        seen = self.sightings.seen_run(hashes)  # leading blocks sighted before
        self.reuse += REUSE_ALPHA * ((seen > 0) - self.reuse)
        # a new chain while the workload reuses, a conversation going on, a session: all of it
        whole = session or 2 * seen >= len(hashes) or (not seen and self.reuse >= WRITE_NEW_CHAINS_AT)
        hi = len(hashes) if whole else seen
        lo = min(hi, plan.reusable_blocks)  # what it computes, as with "all" ...
        if lo and self.unwritten.seen_run(hashes[:1], record=False):  # ... or a prefix left unwritten before,
            store = next((n.node_id for n in self.cluster.of_role("store")  # from the first block the store lacks
                          if n.endpoints.get("store") == plan.store_endpoint), "")
            lo = min(lo, self.index.prefix_runs(hashes[:hi])[0].get(store, 0))
        if hi < len(hashes):
            self.unwritten.seen_run(hashes[:1])
        plan.store_range, plan.decode_writes = (lo, hi), whole
        metrics.store_write_blocks.labels("written").inc(hi - lo)
        metrics.store_write_blocks.labels("skipped").inc(len(hashes) - hi)
