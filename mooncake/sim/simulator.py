"""The discrete-event simulation: trace arrivals -> the conductor's placement (the real
scheduler's plan, admission, booking) -> virtual prefill queues -> KV handoff -> virtual
decode batches; or, where the plan names a colocated instance, its own steps (``colocated_steps.py``).

Each arrival goes through ``sched.placement.place``, as on the conductor: its ``Scheduler``
(with its booking, the ``KVIndex`` fed by the virtual caches and stores, the online cost models
fed with what the simulation measures, and the store tiers' relative fetch costs of the hardware:
``reuse`` charges the hardware's actual ones) plans, ``Admission.check_plan`` rejects early;
``HotBlocks`` finds blocks to replicate. Request classes as the roles serve them: a prefill
queue and a decode instance's waiting requests go by class, then arrival; a flex sequence
joins a decode batch only while the step stays within the TBT SLO (or the batch is empty).
"""

from __future__ import annotations

import math
import random
import time

from mooncake.config import AdmissionConfig, ConductorConfig, ReplicationConfig
from mooncake.config_classes import ClassesConfig
from mooncake.metrics import Metrics
from mooncake.sched.admission import Admission, Rejection
from mooncake.sched.node_registry import Cluster
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.hot_blocks import HotBlocks
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.placement import place
from mooncake.sched.plan import Plan
from mooncake.sched.request_class import DEFAULT_RANK, FLEX_RANK, rank
from mooncake.sched.scheduler import Scheduler
from mooncake.sim.colocated_steps import ColocatedInstance, ColocatedSteps, step_budget
from mooncake.sim.events import EventLoop
from mooncake.sim.hardware import Hardware
from mooncake.sim.instances import (DecodeInstance, DecodeSeq, Prefiller, PrefillInstance, StoreInstance,
                                    queue_by_rank, virtual_node)
from mooncake.sim.block_lru import LRUBlocks
from mooncake.sim.results import Outcome, SimResult, summarize
from mooncake.sim.setup import SimSetup
from mooncake.sim.shared_cpu import SharedCpu
from mooncake.sim.workload import SimRequest


class Simulation:
    def __init__(self, setup: SimSetup, hw: Hardware, requests: list[SimRequest]) -> None:
        self.setup = setup
        self.hw = hw
        self.requests = requests
        self.B = hw.block_tokens
        self.cfg = ConductorConfig(policy=setup.policy, use_store=setup.use_store, store_writes=setup.store_writes)
        limits = AdmissionConfig(ttft_slo_ms=setup.ttft_slo_ms, tbt_slo_ms=setup.tbt_slo_ms,
                                 max_queue_wait_s=setup.max_queue_wait_s)
        replication = ReplicationConfig()  # the conductor's defaults
        self.loop = EventLoop()
        self.index = KVIndex()
        self.cluster = Cluster()
        tps, fixed = hw.prefill_prior()
        step, per_seq, per_1k_kv = hw.decode_prior()
        self.prefill_cost = PrefillCostModel(tokens_per_s=tps, fixed_s=fixed,
                                             fetch_block_s=hw.fetch_block_s("dram", True))
        self.decode_cost = DecodeCostModel(step_s=step, per_seq_s=per_seq, per_1k_kv_s=per_1k_kv)
        self.sched = Scheduler(self.cfg, self.cluster, self.index, self.prefill_cost, self.decode_cost,
                               rng=random.Random(setup.seed), fetch_costs=hw.fetch_costs())
        self.admission = Admission(limits, Metrics(), ClassesConfig())  # the metrics of a simulation go unread
        self.replicas = replication.replicas
        self.hot = HotBlocks(replication.hot_block_hits, replication.hot_window_s)
        caps = hw.caps
        self.stores: dict[str, StoreInstance] = {}
        self.prefills: dict[str, PrefillInstance] = {}
        self.decodes: dict[str, DecodeInstance] = {}
        self.colocated: dict[str, ColocatedInstance] = {}
        for i in range(setup.prefill):
            node = virtual_node(f"prefill-{i}", "prefill", f"p{i}")
            self.prefills[node.node_id] = PrefillInstance(node, LRUBlocks(caps.prefill_cache_blocks),
                                                          self._store(f"store-{i}", f"p{i}"))
            self.cluster.upsert(node)
        for j in range(setup.decode):
            node = virtual_node(f"decode-{j}", "decode", f"d{j}")
            self.decodes[node.node_id] = DecodeInstance(node, caps.decode_kv_tokens, caps.decode_max_batch)
            self.cluster.upsert(node)
        self.step_tokens = min(hw.chunk_tokens, setup.step_tokens or step_budget(hw, setup.tbt_slo_ms)) \
            if setup.colocated else 0
        for k in range(setup.colocated):
            node = virtual_node(f"colocated-{k}", "colocated", f"c{k}", self.step_tokens)
            self.colocated[node.node_id] = ColocatedInstance(
                node, LRUBlocks(caps.prefill_cache_blocks), self._store(f"store-c{k}", f"c{k}"),
                DecodeInstance(node, caps.colocated_kv_tokens, caps.decode_max_batch), self.step_tokens)
            self.cluster.upsert(node)
        self.co = ColocatedSteps(self)
        self.cpu = SharedCpu(hw.colocation) if hw.colocation is not None else None
        self.outcomes: dict[str, Outcome] = {}
        self.gaps: list[tuple[float, float]] = []  # (inter-token time, how many tokens had it)

    def _store(self, node_id: str, machine: str) -> StoreInstance | None:
        """The store on a prefilling instance's machine (none without the store pool)."""
        if not self.setup.use_store:
            return None
        node = virtual_node(node_id, "store", machine)
        self.cluster.upsert(node)
        store = self.stores[node_id] = StoreInstance(node, self.index, self.hw.caps.store_dram_blocks,
                                                     self.hw.caps.store_lmdb_blocks)
        return store

    # ------------------------------------------------------------ run

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        for r in self.requests:
            self.loop.at(r.arrival_s, self._arrive, r)
        self.loop.run()
        return summarize(self.setup, self.hw.name, self.requests, self.outcomes, self.gaps,
                         self.loop.now, time.perf_counter() - t0, self.prefills.values(), self.B, self.step_tokens)

    # ------------------------------------------------------------ conductor

    def rank_of(self, r: SimRequest) -> int:
        """Where ``r`` is served: by its class, or with classes off as default work."""
        return rank(r) if self.setup.classes else DEFAULT_RANK

    def _arrive(self, r: SimRequest) -> None:
        now = self.loop.now
        out = self.outcomes[r.req_id] = Outcome(r)
        placed = place(self.sched, self.admission, r.req_id, r.hashes, r.prompt_tokens, r.output_tokens, self.B, now,
                       rank=self.rank_of(r))
        if isinstance(placed, Rejection):
            out.rejected = placed.reason
            return
        plan = placed.plan
        if self.setup.use_store and plan.reusable_blocks:
            self._note_hits(list(r.hashes[:plan.reusable_blocks]), now)
        # The decode instance reserves the request's memory between two of its engine steps;
        # the prefill is sent once it has (a colocated instance reserves as it takes the prompt).
        d = self.decodes.get(plan.decode.node_id)
        reserved = now
        if d is not None and d.active and d.step_s > 0:
            reserved = d.updated_at + math.ceil((now - d.updated_at) / d.step_s - 1e-9) * d.step_s
        self.loop.at(reserved + self.hw.transit_s(), self._enqueue_prefill, r, plan)

    def _enqueue_prefill(self, r: SimRequest, plan: Plan) -> None:
        if plan.colocated:  # (the conductor learns no dispatch time from colocated attempts)
            self.co.enqueue(self.colocated[plan.prefill.node_id], r, plan)
            return
        if not plan.queue_s and not plan.reserve_wait_s:  # as the conductor learns it
            self.prefill_cost.dispatch.observe(self.loop.now - r.arrival_s)
        inst = self.prefills[plan.prefill.node_id]
        queue_by_rank(inst.queue, (r, plan), lambda item: self.rank_of(item[0]))
        if inst.job is None:
            self._start_prefill(inst)

    def _note_hits(self, hashes: list[bytes], now: float) -> None:
        """Hot blocks get copies in more stores, up to ``replicas`` (as the conductor's replicator)."""
        hot = self.hot.hit(hashes, now)
        want = min(self.replicas, len(self.stores))
        if not hot or want < 2:
            return
        for h in hot:
            holders = [n for n in self.index.holders(h) if n in self.stores]
            if holders and len(holders) < want:
                target = min((s for s in self.stores if s not in holders), key=self.index.blocks_of)
                self.stores[target].put([h])

    # ------------------------------------------------------------ prefill

    def _start_prefill(self, inst: PrefillInstance) -> None:
        if not inst.queue:
            self.set_computing(inst.node.node_id, False)
            return
        r, plan = inst.queue.popleft()
        now = self.loop.now
        device, reused, fetch_s = self.reuse(inst, r, plan)
        cached = reused * self.B
        n_new = r.prompt_tokens - cached
        compute_s = self.hw.prefill_s(n_new, cached)
        out = self.outcomes[r.req_id]
        out.started_s, out.device_blocks, out.reused_blocks = now, device, reused
        work = fetch_s + compute_s
        inst.job, inst.work_left, inst.work_since = (r, plan, n_new, cached, compute_s, work, now), work, now
        if not self.set_computing(inst.node.node_id, True):
            self._schedule_prefill_end(inst)

    def reuse(self, inst: Prefiller, r: SimRequest, plan: Plan) -> tuple[int, int, float]:
        """What ``inst`` reuses of ``r``'s prompt, read as it goes: (blocks in its device cache,
        blocks reused in all, seconds to read the rest of them from the stores)."""
        usable = min(len(r.hashes), (r.prompt_tokens - 1) // self.B)
        flex = self.rank_of(r) == FLEX_RANK
        reused = device = inst.cache.leading_run(r.hashes[:usable], flex)
        fetch_s = 0.0
        if self.setup.use_store:  # the plan's store segments, as far as the stores still hold them
            local = inst.store.node.node_id if inst.store is not None else None
            for h in r.hashes[reused:min(plan.reusable_blocks, usable)]:
                holders = self.index.holders(h)
                src = local if local in holders else next((n for n in holders if n in self.stores), None)
                if src is None:
                    break
                store = self.stores[src]
                fetch_s += self.hw.fetch_block_s(store.tier_of(h) or "dram", src == local)
                store.read(h, flex)
                reused += 1
        return device, reused, fetch_s

    def prefilled(self, inst: Prefiller, r: SimRequest, plan: Plan) -> None:
        """``r``'s prompt is computed: its blocks join ``inst``'s device cache, and its store those
        the write admission lets through."""
        out = self.outcomes[r.req_id]
        flex = self.rank_of(r) == FLEX_RANK
        inst.cache_blocks(self.index, r.hashes, flex)
        if inst.store is not None and plan.store_endpoint:
            lo, hi = plan.store_range or (out.reused_blocks, len(r.hashes))
            inst.store.put(r.hashes[lo:hi], flex)
            out.written_blocks = max(0, hi - lo)

    def _schedule_prefill_end(self, inst: PrefillInstance) -> None:
        inst.version += 1
        self.loop.after(inst.work_left / self.speed(), self._end_prefill, inst, inst.version)

    def _end_prefill(self, inst: PrefillInstance, version: int) -> None:
        if version != inst.version:
            return
        now = self.loop.now
        r, plan, n_new, cached, compute_s, work, started = inst.job
        inst.job = None
        inst.busy_s += now - started
        self.outcomes[r.req_id].first_token_s = now
        self.prefilled(inst, r, plan)
        self.sched.prefill_finished(r.req_id)
        # The engine times its compute on the wall clock, sharing included (as the real one does).
        self.prefill_cost.observe(n_new, cached, compute_s * (now - started) / work if work > 0 else compute_s)
        if r.output_tokens <= 1:
            self.finish(r.req_id)
        else:
            seq = DecodeSeq(r.req_id, float(r.output_tokens - 1), float(r.prompt_tokens),
                            r.prompt_tokens + r.output_tokens, self.rank_of(r))
            self.loop.after(self.hw.kv_handoff_s(r.prompt_tokens, compute_s), self._join_decode,
                            self.decodes[plan.decode.node_id], seq)
        self._start_prefill(inst)

    # ------------------------------------------------------------ decode

    def _join_decode(self, d: DecodeInstance, seq: DecodeSeq) -> None:
        d.advance(self.loop.now, self.gaps)
        queue_by_rank(d.waiting, seq, lambda s: s.rank)
        self._admit(d)
        self._batch_changed(d)

    def _admit(self, d: DecodeInstance) -> None:
        while d.waiting:
            if not d.fits(d.waiting[0]):
                if not self._preempt_flex_for(d, d.waiting[0]):
                    return
                continue
            if not self._flex_fits(d, d.waiting[0]):
                return
            seq = d.waiting.popleft()
            d.active[seq.req_id] = seq
            d.kv_reserved += seq.reserved
            self.outcomes[seq.req_id].decode_joined_s = self.loop.now

    def _preempt_flex_for(self, d: DecodeInstance, seq: DecodeSeq) -> bool:
        """An interactive sequence that does not fit takes the room of the newest flex one, which
        waits to resume (as a decode instance preempts flex work); False if that cannot make it fit."""
        flex = [s for s in d.active.values() if s.rank == FLEX_RANK]
        if seq.rank == FLEX_RANK or not flex or len(d.active) - len(flex) >= d.max_batch or \
                d.kv_reserved - sum(s.reserved for s in flex) + seq.reserved > d.kv_capacity:
            return False
        victim = flex[-1]
        del d.active[victim.req_id]
        d.kv_reserved -= victim.reserved
        queue_by_rank(d.waiting, victim, lambda s: s.rank)
        return True

    def _flex_fits(self, d: DecodeInstance, seq: DecodeSeq) -> bool:
        """A flex sequence joins a batch only while its step stays within the TBT SLO (or the
        batch is empty), as a decode instance's step takes flex work."""
        slo_s = self.setup.tbt_slo_ms / 1000
        if seq.rank != FLEX_RANK or not slo_s or not d.active:
            return True
        kv = sum(s.kv_tokens for s in d.active.values()) + seq.kv_tokens
        return self.hw.decode_step_s(len(d.active) + 1, kv) <= slo_s

    def _batch_changed(self, d: DecodeInstance) -> None:
        if not (self.set_computing(d.node.node_id, bool(d.active)) and d.active):  # else rescheduled there
            self._reschedule(d)

    def _reschedule(self, d: DecodeInstance) -> None:
        """New step time for the new batch; the next completion event."""
        d.version += 1
        if not d.active:
            d.step_s = 0.0
            return
        kv_tokens = sum(s.kv_tokens for s in d.active.values())
        d.step_s = self.hw.decode_step_s(len(d.active), kv_tokens) / self.speed()
        self.decode_cost.observe(len(d.active), int(kv_tokens), d.step_s)
        left = min(s.remaining for s in d.active.values())
        self.loop.after(max(0.0, left) * d.step_s, self._decode_tick, d, d.version)

    def _decode_tick(self, d: DecodeInstance, version: int) -> None:
        if version != d.version:
            return
        d.advance(self.loop.now, self.gaps)
        for req_id in d.retire_finished():
            self.finish(req_id)
        self._admit(d)
        self._batch_changed(d)

    # ------------------------------------------------------------ instances sharing cores

    def speed(self) -> float:
        return self.cpu.speed() if self.cpu is not None else 1.0

    def set_computing(self, node_id: str, computing: bool) -> bool:
        """With instances sharing cores (``hw.colocation``): a change in who computes changes
        everyone's speed, so the work done so far is accounted at the old speed and every
        running prefill, decode batch and colocated step is rescheduled at the new one. True
        when it did."""
        cpu = self.cpu
        if cpu is None or computing == (node_id in cpu.computing):
            return False
        now, old = self.loop.now, cpu.speed()
        running = [p for p in self.prefills.values() if p.job is not None]
        for p in running:
            p.work_left -= (now - p.work_since) * old
            p.work_since = now
        batches = [d for d in self.decodes.values() if d.active]
        for d in batches:
            d.advance(now, self.gaps)
        steps = [c for c in self.colocated.values() if c.running]
        for c in steps:
            self.co.account(c)
        cpu.set_computing(node_id, computing)
        for p in running:
            self._schedule_prefill_end(p)
        for d in batches:
            self._reschedule(d)
        for c in steps:
            self.co.schedule(c)
        return True

    def finish(self, req_id: str) -> None:
        self.outcomes[req_id].finished_s = self.loop.now
        self.sched.release(req_id)


def simulate(setup: SimSetup, hw: Hardware, requests: list[SimRequest]) -> SimResult:
    return Simulation(setup, hw, requests).run()
