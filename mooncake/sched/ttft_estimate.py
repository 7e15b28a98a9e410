"""The TTFT estimate, one formula for the scheduler's instances, its pipeline groups and (through
the scheduler it runs) the simulator:

    TTFT = dispatch + queue ahead + the store blocks to fetch, each at its tier's cost + prefill

A block's fetch cost depends on the store tier it is read from (``FetchCosts``). What is measured
and what is assumed:

- measured: ``PrefillCostModel.fetch_block_s``, a moving average of the seconds per block prefill
  instances report fetching. They report one time for all a request's blocks, whatever their
  tiers, and most come from DRAM: it is the DRAM (and default) figure;
- assumed: every other tier costs that figure times a constant ratio (``TIER_FETCH_RATIOS``); the
  simulator passes its hardware's own ratios instead;
- known: the tier of each block on each store (the KV index records it from the stores' events).
  The estimate charges each block at the tier of the copy the stores' covering run reads (the
  first holder at each point: the fetch plan's choice but for its preference for local stores).
"""

from __future__ import annotations

from itertools import accumulate, repeat
from types import MappingProxyType
from typing import Collection, Iterable, Mapping, Sequence

from mooncake.sched.cost_model import PrefillCostModel
from mooncake.sched.kv_index import KVIndex

DRAM_FETCH_RATIO = 1.0  # the measured figure itself
# A store's device tier, read on CPU, as fast as DRAM (BENCHMARKS.md section 6); on CUDA its extra
# copy to the host is not measured.
DEVICE_FETCH_RATIO = 1.0
# LMDB through a store over DRAM through it, 1 MiB (BENCHMARKS.md section 6): a local store's shared
# memory get (4.81 GB/s; fetch plans read local stores first) plus the LMDB tier's get (4.75 GB/s, page
# cache) in place of DRAM's (17.44 GB/s). Over ZeroMQ (1.86 GB/s) it is 1.3; off a cold SSD, more.
LMDB_FETCH_RATIO = 1.7
TIER_FETCH_RATIOS: Mapping[str, float] = MappingProxyType(
    {"device": DEVICE_FETCH_RATIO, "dram": DRAM_FETCH_RATIO, "lmdb": LMDB_FETCH_RATIO})


class FetchCosts:
    """Seconds per block fetched from each store tier, as ratios to the measured default (a tier
    not named: 1)."""

    __slots__ = ("ratios", "off_default")

    def __init__(self, ratios: Mapping[str, float] = TIER_FETCH_RATIOS) -> None:
        self.ratios = MappingProxyType(dict(ratios))
        self.off_default = frozenset(t for t, r in self.ratios.items() if r != 1.0)  # the tiers that cost more or less

    def per_block_s(self, default_s: float) -> dict[str, float]:
        """Each tier's seconds per block when the default is ``default_s``."""
        return {tier: default_s * r for tier, r in self.ratios.items()}


class TTFTEstimate:
    """One request's estimated TTFT on any instance or group: built once per request (the tiers of
    its store-held blocks looked up once), then evaluated per candidate in constant time."""

    __slots__ = ("dispatch_s", "fetch_block_s", "_fetch_to", "_known")

    def __init__(self, dispatch_s: float, fetch_block_s: float, costs: FetchCosts | None = None,
                 tiers: Iterable[str] = ()) -> None:
        """``fetch_block_s``: the measured default; ``tiers``: the tier of the prompt's blocks from
        block 0 on, as far as the stores hold them (blocks past them cost the default)."""
        self.dispatch_s = dispatch_s
        self.fetch_block_s = fetch_block_s
        self._fetch_to: list[float] = [0.0]  # [i]: seconds to fetch blocks 0..i-1 (of known tiers)
        if costs is not None and costs.off_default:
            per = costs.per_block_s(fetch_block_s)
            self._fetch_to = list(accumulate(map(per.get, tiers, repeat(fetch_block_s)), initial=0.0))
        self._known = len(self._fetch_to) - 1  # blocks of known tiers (0: every block at the default)

    @classmethod
    def of_prompt(cls, prefill_cost: PrefillCostModel, costs: FetchCosts, index: KVIndex,
                  hashes: Sequence[bytes], stores: Collection[str], runs: dict[str, int],
                  store_end: int) -> TTFTEstimate:
        """The estimate for a prompt whose first ``store_end`` blocks the ``stores`` hold
        (``runs``, ``store_end``: ``KVIndex.prefix_runs`` of ``hashes`` over them). The tiers are
        looked up only where the index ever held a block in a tier off the default cost."""
        lookup = store_end > 0 and not costs.off_default.isdisjoint(index.tiers_seen)
        tiers = index.run_tiers(hashes[:store_end], stores, runs) if lookup else ()
        return cls(prefill_cost.dispatch.value, prefill_cost.fetch_block_s, costs, tiers)

    def ttft_s(self, queue_s: float, dev: int, reusable: int, prefill_s: float) -> float:
        """Dispatch + ``queue_s`` + fetching blocks ``dev..reusable`` from the stores + ``prefill_s``
        (``dev``: the leading blocks the instance holds; ``reusable``: those it will not compute)."""
        if reusable <= dev:
            fetch_s = 0.0
        elif reusable <= self._known:
            fetch_s = self._fetch_to[reusable] - self._fetch_to[dev]
        else:  # blocks past those of known tiers cost the default
            known = self._known
            if dev >= known:
                fetch_s = (reusable - dev) * self.fetch_block_s
            else:
                fetch_s = self._fetch_to[known] - self._fetch_to[dev] + (reusable - known) * self.fetch_block_s
        return self.dispatch_s + queue_s + fetch_s + prefill_s
