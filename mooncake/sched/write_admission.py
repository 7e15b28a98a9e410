"""Which of a request's blocks go to the store (issue 33), with ``[conductor] store_writes =
"reused"``: a prompt whose prefix recurs — its leading block was sighted in an earlier request
(``sightings.py``) — has its blocks written, and so does a session's (the next turn reads them),
and its decode writes the blocks it completes; a chain seen for the first time is written too
while the workload reuses (at least ``WRITE_FIRST_SIGHTINGS_AT`` of recent requests start with a
recurring prefix), and left in the prefill's device cache alone otherwise. So a workload with no
reuse writes nothing to the store, and one with reuse writes what it did before; a prefix left
unwritten the first time is written on its second sighting, from the device cache of the prefill
that holds it when it is cached there (``Plan.store_range`` starts at the first block the store
lacks). ``"all"`` writes every block a prefill computes and every block a decode completes."""

from __future__ import annotations

from typing import Sequence

from mooncake.metrics import Metrics
from mooncake.sched.cluster import Cluster
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.plan import Plan
from mooncake.sched.sightings import Sightings

REUSE_ALPHA = 1 / 256  # weight of each request in ``WriteAdmission.reuse``
WRITE_FIRST_SIGHTINGS_AT = 0.01  # from this share of recurring requests on, new chains are written at once


class WriteAdmission:
    def __init__(self, policy: str, cluster: Cluster, index: KVIndex) -> None:
        self.policy = policy
        self.cluster = cluster
        self.index = index
        self.sightings = Sightings()  # every prompt's blocks
        self.unwritten = Sightings()  # the blocks of prompts left unwritten
        self.reuse = 0.0  # the share of recent requests whose prompt starts with a recurring prefix

    def admit(self, plan: Plan, hashes: Sequence[bytes], session: bool, metrics: Metrics) -> None:
        """Set ``plan.store_range`` (blocks ``[lo, hi)`` of the chain to write) and whether its
        decode writes the blocks it completes (``decode_writes``); counted in
        ``mooncake:store_write_blocks_total{decision}``."""
        if self.policy == "all" or not plan.store_endpoint or not hashes:
            return
        recurs = self.sightings.seen_run(hashes) > 0
        self.reuse += REUSE_ALPHA * (recurs - self.reuse)
        write = recurs or session or self.reuse >= WRITE_FIRST_SIGHTINGS_AT
        if not write:
            self.unwritten.seen_run(hashes)
            plan.store_range, plan.decode_writes = (0, 0), False
            metrics.store_write_blocks.labels("skipped").inc(len(hashes))
            return
        lo = plan.reusable_blocks  # what it computes, as with "all" ...
        if self.unwritten.seen_run(hashes, record=False):  # ... or a prefix left unwritten before, from its start
            store = next((n.node_id for n in self.cluster.of_role("store")
                          if n.endpoints.get("store") == plan.store_endpoint), "")
            lo = min(lo, self.index.prefix_runs(hashes)[0].get(store, 0))
        plan.store_range, plan.decode_writes = (lo, len(hashes)), True
        metrics.store_write_blocks.labels("written").inc(len(hashes) - lo)
