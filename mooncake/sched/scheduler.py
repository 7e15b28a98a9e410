"""Mooncake's conductor policy: pick a prefill/decode pair per request, and book its load.

For each prefill instance the estimated TTFT (``ttft_estimate.py``) is its queue
wait + the time to fetch the prefix blocks it lacks from the stores, each at its
store tier's cost + the prefill time of the tokens still uncached; blocks that requests booked ahead of it on the same
instance will compute count as cached. The decode instance is chosen by the
batch it is expected to run when this request's prefill finishes, preferring
one whose KV pool has room now: the prefill starts only once the decode
instance has reserved the request's blocks, so a full pool's predicted wait
(until enough booked requests end) is part of the TTFT. The plan says everything
the conductor needs to dispatch (instances, fetch segments, the store to write
to) and the predictions admission judges against the SLOs — among them, since a
prefill instance packs the chunks of its queued requests into one forward, the
first-token deadline due soonest among the requests queued there that are
predicted to meet it. An admitted plan's predicted load is booked
(``placement.py``); its ``Booking`` is handed back when the attempt ends.

With pipeline groups (``[conductor] cpp_group_size`` > 1, ``pipeline.py``), a prompt with at least
``cpp_min_tokens`` tokens to compute is also estimated on every group (its slowest member's queue,
the group's shared prefix, the pipeline's prefill time); a group is chosen only when it beats the
best single instance, and its work is booked on every stage's queue.
"""

from __future__ import annotations

import itertools
import math
import random
from bisect import bisect_right
from operator import itemgetter
from typing import Sequence

from mooncake.config import ConductorConfig
from mooncake.protocol import FetchPlan
from mooncake.sched.booking import Booking, DecodeSlots, PendingBlocks, PrefillQueue
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.colocated_budget import mixed_prefill_s, mixed_tbt_s
from mooncake.sched.pipeline import PipelineShape, best_group
from mooncake.sched.plan import Plan
from mooncake.sched.request_class import DEFAULT_RANK, FLEX_RANK, RANKS
from mooncake.sched.ttft_estimate import FetchCosts, TTFTEstimate
from mooncake.sched.write_admission import WriteAdmission


_NO_SLOTS = DecodeSlots()  # a decode instance nothing is booked on (read, never written)


class Scheduler:
    def __init__(self, cfg: ConductorConfig, cluster: Cluster, index: KVIndex,
                 prefill_cost: PrefillCostModel, decode_cost: DecodeCostModel,
                 rng: random.Random | None = None, fetch_costs: FetchCosts | None = None) -> None:
        """``fetch_costs``: the store tiers' fetch costs relative to the measured one (None: the defaults)."""
        self.cfg = cfg
        self._rng = rng if rng is not None else random.Random(0)  # the ``random`` policy's draws
        self.cluster = cluster
        self.index = index
        self.prefill_cost = prefill_cost
        self.decode_cost = decode_cost
        self.fetch_costs = fetch_costs if fetch_costs is not None else FetchCosts()
        self._rr = itertools.count()
        self.queues: dict[str, PrefillQueue] = {}
        self.slots: dict[str, DecodeSlots] = {}  # every booking on each decode instance
        # the bookings of interactive classes alone: what an interactive request's plan counts, as
        # flex work gives way to it there (preempted for room; out of a step past the TBT SLO)
        self.interactive_slots: dict[str, DecodeSlots] = {}
        self._booked: dict[str, Booking] = {}
        self._in_flight = [0] * RANKS  # bookings by class
        self.pending = PendingBlocks()  # every booking's
        # the bookings of interactive classes alone: what an interactive request's plan counts on
        # (a flex request booked before it computes its blocks after it)
        self.interactive_pending = PendingBlocks()
        self._stores_version = -1  # the cluster version ``_store_view``/``_local_view`` were built at
        self._store_view: dict[str, Node] = {}
        self._local_view: dict[str, tuple[list[str], str]] = {}
        self.writes = WriteAdmission(cfg.store_writes, cluster, index)  # which blocks go to the store

    # ------------------------------------------------------------ planning

    def plan(self, hashes: Sequence[bytes], n_tokens: int, max_tokens: int, block_tokens: int,
             now: float, pipeline: PipelineShape | None = None, rank: int = DEFAULT_RANK) -> Plan | None:
        """Where a request of ``n_tokens`` (``hashes``: its full blocks) runs: a prefill/decode pair or
        a colocated instance (``colocated_budget.py``), whichever is predicted to serve it sooner; None when
        neither takes work. ``pipeline``: consider pipeline groups too; ``rank``: its class's
        (``request_class.py``): it waits only for the queued work served before it.

        It runs once per request on the conductor's event loop, over every instance: the loops
        below avoid per-instance calls and allocations (BENCHMARKS.md section 13)."""
        prefills, decodes = self.cluster.of_role("prefill"), self.cluster.of_role("decode")
        colocated = self.cluster.of_role("colocated")
        if not decodes:
            prefills = []
        if not prefills and not colocated:
            return None
        stores = self._stores()
        # Blocks must leave at least one prompt token to compute (it yields the logits).
        usable = min(len(hashes), (n_tokens - 1) // block_tokens)
        # One walk: each node's leading run (at most ``usable``), and how far the stores together cover the chain.
        runs, store_end = self.index.prefix_runs(hashes[:usable], stores)
        estimate = TTFTEstimate.of_prompt(self.prefill_cost, self.fetch_costs, self.index, hashes, stores, runs,
                                          store_end)
        ttft_s = estimate.ttft_s  # looked up once for the loop
        prefill_time: dict[int, float] = {}  # by reusable blocks: most instances share one value

        queues = self.queues
        all_slots, pending_blocks = self.views(rank)
        pending = pending_blocks.nodes()
        candidates = []  # (est TTFT, prefill s, device blocks, reusable blocks, instance, its queue s)
        for p in itertools.chain(prefills, colocated):
            nid = p.node_id
            queue = queues.get(nid)
            q = queue.ahead_s(rank) if queue is not None else 0.0
            if nid in pending:
                dev = self.resident_run(pending_blocks, nid, hashes, runs.get(nid, 0), usable)
            else:
                dev = runs.get(nid, 0)
            reusable = dev if dev > store_end else store_end
            prefill_s = prefill_time.get(reusable)
            if prefill_s is None:
                cached = reusable * block_tokens
                prefill_s = prefill_time[reusable] = self.prefill_cost.predict(n_tokens - cached, cached)
            if p.role == "colocated":  # its chunks share steps with its decoding batch
                prefill_s = mixed_prefill_s(self.prefill_cost, self.decode_cost, self.slots.get(nid), p, prefill_s,
                                            n_tokens - reusable * block_tokens, block_tokens)
            candidates.append((ttft_s(q, dev, reusable, prefill_s), prefill_s, dev, reusable, p, q))

        if self.cfg.policy == "random":
            chosen = [candidates[self._rng.randrange(len(candidates))]]
        elif self.cfg.policy == "round_robin":
            chosen = [candidates[next(self._rr) % len(candidates)]]
        elif self.cfg.policy == "least_loaded":
            chosen = [min(candidates, key=lambda c: (c[5], self.queued(c[4].node_id)))]
        else:  # the fastest prefill, and the fastest colocated instance
            chosen = [min(c, key=itemgetter(0)) for c in (candidates[:len(prefills)], candidates[len(prefills):]) if c]
        if prefills and pipeline is not None and pipeline.group_size > 1 and chosen[0][4].role == "prefill":
            group = best_group(pipeline, prefills, self.prefill_cost, estimate,
                               lambda n: self.resident_run(pending_blocks, n.node_id, hashes, runs.get(n.node_id, 0), usable),
                               lambda n: self.queue_s(n.node_id, rank), store_end, n_tokens, block_tokens)
            if group is not None and group[0] < min(c[0] for c in candidates):
                est, prefill_s, dev, reusable, stages = group
                chosen[0] = (est, prefill_s, dev, reusable, stages[-1], self.queue_s(stages[-1].node_id, rank), stages)
                candidates.append(chosen[0][:6])
        plans = [self._placed(c, decodes, candidates, hashes, runs, usable, stores, n_tokens, max_tokens, block_tokens,
                              now, rank) for c in chosen]
        return min(plans, key=lambda plan: plan.expected_end) if len(plans) > 1 else plans[0]

    def _placed(self, chosen: tuple, decodes: list[Node], candidates: list[tuple], hashes: Sequence[bytes],
                runs: dict[str, int], usable: int, stores: dict[str, Node], n_tokens: int, max_tokens: int,
                block_tokens: int, now: float, rank: int) -> Plan:
        """The plan once its prefill instance is chosen: a colocated instance decodes too; a
        prefill's decode instance is one with room in its pool now, then the smallest batch when
        the first token comes, then the shortest wait for room."""
        est, prefill_s, dev, reusable, p, p_queue_s, *rest = chosen
        stages: list[Node] = rest[0] if rest else []
        all_slots, pending_blocks = self.views(rank)
        pending = pending_blocks.nodes()
        full = min(len(hashes), n_tokens // block_tokens)
        total_blocks = -(-(n_tokens + max_tokens) // block_tokens) + 1  # + the reservation's headroom
        ready_at = now + est
        best_key: tuple | None = None
        for d in [p] if p.role == "colocated" else decodes:
            nid, capacity = d.node_id, d.info.num_blocks
            slots = all_slots.get(nid, _NO_SLOTS)
            resident = self.resident_run(pending_blocks, nid, hashes, runs.get(nid, 0), full) \
                if nid in pending else runs.get(nid, 0)
            need = total_blocks - resident
            ends = slots.ends  # the batch it joins: those still decoding then, and itself (``running_at``)
            if capacity <= 0 or slots.blocks_total + need <= capacity:  # room now
                batch = len(ends) - bisect_right(ends, ready_at) + 1
                if best_key is None or best_key[0] or batch < best_key[1]:  # the first of equals: in instance order
                    best_key, best = (False, batch, 0.0), (ready_at, need, d)
                continue
            wait = slots.room_at(need, capacity, now) - now
            first_token_at = ready_at + max(0.0, wait - p_queue_s)
            key = (wait > 0, len(ends) - bisect_right(ends, first_token_at) + 1, wait)
            if best_key is None or key < best_key:
                best_key, best = key, (first_token_at, need, d)
        assert best_key is not None
        _, batch, wait = best_key
        first_token_at, need, decode = best
        # the batch's KV: this request's halfway through its output, the others' as the average booked
        kv_tokens = n_tokens + max_tokens // 2
        slots = all_slots.get(decode.node_id, _NO_SLOTS)  # read only: planning books nothing
        others = slots.kv_tokens_total / len(slots.assigned) if slots.assigned else kv_tokens
        tbt = self.decode_cost.predict(batch, int(kv_tokens + (batch - 1) * others))
        if decode is p:  # a colocated instance's steps also carry the prompts queued there
            tbt += mixed_tbt_s(self.prefill_cost, self.decode_cost, self.slots.get(p.node_id), self.queue_s(p.node_id), p,
                               max_tokens)
        ttft = first_token_at - now
        if wait > 0:
            best_ttft = min(c[0] + max(0.0, wait - c[5]) for c in candidates)
        else:
            best_ttft = min(map(itemgetter(0), candidates))

        local, write_to = self._local_stores(p)
        fetch: list[FetchPlan] = []
        if reusable > dev:  # read from the stores local to the chosen instance first
            fetch = [FetchPlan(s, e, stores[node].endpoints["store"])
                     for s, e, node in self.index.covering_run(hashes[:reusable], dev, stores, local, runs)]
        queue = self.queues.get(p.node_id)
        slack = (queue.earliest_deadline(now, rank) if queue is not None else math.inf) - now
        return Plan(p, decode, fetch, write_to, dev, reusable, prefill_s, ttft, best_ttft, batch, tbt,
                    first_token_at + max_tokens * tbt, slots.next_end_after(first_token_at) - first_token_at,
                    reserve_wait_s=wait, queue_s=p_queue_s, queue_slack_s=slack,
                    decode_blocks=need, decode_kv_tokens=kv_tokens, hashes=hashes[:full], stages=stages)

    def resident_run(self, pending_blocks: PendingBlocks, node_id: str, hashes: Sequence[bytes], indexed: int,
                      limit: int) -> int:
        """Leading blocks of ``hashes`` (at most ``limit``) an instance holds, or will hold once
        the requests booked on it (``pending_blocks``: those served before) are; ``indexed``:
        its run in the KV index."""
        pending = pending_blocks.of(node_id)
        run = min(indexed, limit)
        # A booked chain is pending from its block 0 (a block's hash names its whole prefix) where
        # the index does not hold it, so what is pending of ``hashes`` starts at ``run``, if at all:
        # bisect its end; then what the index holds past it.
        if pending and run < limit and hashes[run] in pending:
            lo, hi = run + 1, limit
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid] in pending:
                    lo = mid + 1
                else:
                    hi = mid
            run = lo
        while run < limit and self.index.holds(node_id, hashes[run]):  # ``indexed`` may stop short of ``limit``
            run += 1
        return run

    def _stores(self) -> dict[str, Node]:
        """The stores plans may read and write (none with ``use_store`` off), kept until the
        cluster's membership changes."""
        if self._stores_version != self.cluster.version:
            self._store_view = {n.node_id: n for n in self.cluster.of_role("store")} if self.cfg.use_store else {}
            self._local_view = {}
            self._stores_version = self.cluster.version
        return self._store_view

    def _local_stores(self, prefill: Node) -> tuple[list[str], str]:
        """The stores on ``prefill``'s machine, and the store its new blocks go to: a local
        one, else any ("" for none)."""
        view = self._local_view.get(prefill.name)
        if view is None:
            stores = list(self._store_view.values())
            local = [s for s in stores if s.name == prefill.name]
            write_to = min(local or stores, key=lambda s: s.node_id).endpoints["store"] if stores else ""
            view = self._local_view[prefill.name] = ([s.node_id for s in local], write_to)
        return view

    # ------------------------------------------------------------ booking

    def book(self, req_id: str, plan: Plan, deadline: float = math.inf, rank: int = DEFAULT_RANK) -> Booking:
        """Reserve the plan's predicted load: its prefill work and a decode slot (``deadline``:
        when its first token is due, if it has an SLO; ``rank``: its class's)."""
        self.release(req_id)
        booking = self._booked[req_id] = Booking(self.prefill_finished, self.release, req_id, plan, rank)
        self._in_flight[rank] += 1
        for node_id in plan.prefill_ids:
            self._queue(node_id).add(req_id, plan.est_prefill_s, deadline, rank)
        for slots, pending in self._kept_in(rank):
            _slots(slots, plan.decode.node_id).add(req_id, plan.expected_end, plan.decode_blocks, plan.decode_kv_tokens)
            if not plan.stages:  # stages hold only their layers: the blocks never become reusable there
                pending.add(plan.prefill.node_id, booking.hashes)
            pending.add(plan.decode.node_id, booking.hashes)
        return booking

    def prefill_finished(self, req_id: str) -> None:
        """The request left its prefill instance's queue (it is decoding now)."""
        b = self._booked.get(req_id)
        if b is not None and not b.prefilled:
            b.prefilled = True
            for node_id in b.plan.prefill_ids:
                self._queue(node_id).remove(req_id)
            if not b.plan.stages and not b.plan.colocated:  # a colocated one still holds them
                for _, pending in self._kept_in(b.rank):
                    pending.remove(b.plan.prefill.node_id, b.hashes)

    def release(self, req_id: str) -> None:
        """All the request's booked load (it finished, failed or moved)."""
        b = self._booked.pop(req_id, None)
        if b is not None:
            self._in_flight[b.rank] -= 1
            plan = b.plan
            for node_id in plan.prefill_ids:
                self._queue(node_id).remove(req_id)
            for slots, pending in self._kept_in(b.rank):
                if not b.prefilled and not plan.stages:
                    pending.remove(plan.prefill.node_id, b.hashes)
                pending.remove(plan.decode.node_id, b.hashes)
                slots.get(plan.decode.node_id, _NO_SLOTS).remove(req_id)

    def forget_node(self, node_id: str) -> None:
        self.queues.pop(node_id, None)
        self.slots.pop(node_id, None)
        self.interactive_slots.pop(node_id, None)
        self.pending.forget_node(node_id)
        self.interactive_pending.forget_node(node_id)

    # ------------------------------------------------------------ load views

    def queue_s(self, node_id: str, rank: int = FLEX_RANK) -> float:
        """Predicted seconds of work queued on a prefill instance (ahead of a request of ``rank``)."""
        q = self.queues.get(node_id)
        return q.ahead_s(rank) if q is not None else 0.0

    def queued(self, node_id: str) -> int:
        q = self.queues.get(node_id)
        return len(q.work) if q is not None else 0

    def assigned(self, node_id: str) -> int:
        s = self.slots.get(node_id)
        return len(s.assigned) if s is not None else 0

    def waiting(self, rank: int | None = None) -> int:
        """Requests booked on prefill queues cluster-wide (queued or computing); ``rank``: only
        those of that class."""
        if rank is None:
            return sum(len(q.work) for q in self.queues.values())
        return sum(q.requests_of(rank) for q in self.queues.values())

    def in_flight(self, rank: int) -> int:
        """Attempts of class ``rank`` booked (placed, not yet ended) cluster-wide."""
        return self._in_flight[rank]

    def views(self, rank: int) -> tuple[dict[str, DecodeSlots], PendingBlocks]:
        """What a plan of ``rank`` counts on the instances: every booking for flex work; for the
        others, the interactive bookings alone (flex work gives way to them)."""
        return (self.slots, self.pending) if rank == FLEX_RANK else (self.interactive_slots, self.interactive_pending)

    def _kept_in(self, rank: int) -> list[tuple[dict[str, DecodeSlots], PendingBlocks]]:
        """The views a booking of ``rank`` is part of."""
        views = [(self.slots, self.pending)]
        return views if rank == FLEX_RANK else views + [(self.interactive_slots, self.interactive_pending)]

    def _queue(self, node_id: str) -> PrefillQueue:
        q = self.queues.get(node_id)
        if q is None:
            q = self.queues[node_id] = PrefillQueue()
        return q



def _slots(slots: dict[str, DecodeSlots], node_id: str) -> DecodeSlots:
    s = slots.get(node_id)
    if s is None:
        s = slots[node_id] = DecodeSlots()
    return s
