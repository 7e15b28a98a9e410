"""The decoding half of an instance, shared by the decode and colocated roles: requests waiting
for room, reserved ones whose KV is arriving (or being computed), the running batch, its steps,
preemption and retirement, the tokens to the frontends.

A ``DecodeRequest`` waits (by request class, then in order) until the pool has room for its KV
and one more block per running sequence, and the role's ``Admission`` lets it in; then it holds its
blocks (``Admission.hold``) and is answered ``Reserved``. Once its first token is known and the role
says its KV is in (``Admission.ready``) it joins the batch (a flex one only while the others'
predicted step stays within the TBT SLO, and not while an interactive request's prefill runs on this
machine, whose cores they share); each step streams one token per sequence (several where a
speculative step accepted drafts) straight to the frontend that owns the request
(``token_outlets.py``). When a step needs blocks the pool no longer has, sequences are preempted
(flex work first, then the newest), as flex work is for an interactive request waiting for room:
their full blocks go to the store and their frontend gives them a new attempt, which resumes where
they were.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable, Protocol

from mooncake import protocol as P
from mooncake.engine import Sequence
from mooncake.engine.errors import InvalidRequestError
from mooncake.engine.sequence import StepOutput
from mooncake.kv.ingress import Slot
from mooncake.roles.engine_host import EngineHost
from mooncake.roles.slot_trace import trace_slot
from mooncake.roles.timing import YIELD_AT_MOST_S
from mooncake.roles.token_outlets import TokenOutlets
from mooncake.sched.colocated_budget import reachable_target_ms
from mooncake.sched.cost_model import DecodeCostModel
from mooncake.sched.request_class import (FLEX_RANK, flex_allowance_s, flex_joining, rank, tightest_target_ms, urgency,
                                          yields_to)

log = logging.getLogger(__name__)
STEPS_PER_S = 32  # decode steps a second the conductor's cost model learns from (a refit reads 256)


class Admission(Protocol):
    """What differs between the roles that decode: how a request's blocks are held, when it may
    hold them, and when its KV is in."""

    def may_reserve(self, msg: P.DecodeRequest) -> bool:
        """Whether ``msg``, next in line, may reserve now (room permitting)."""

    async def hold(self, msg: P.DecodeRequest) -> Sequence | None:
        """Blocks for ``msg``'s KV; None if the pool cannot hold them now."""

    def ready(self, slot: Slot) -> bool:
        """Whether ``slot``'s KV is all in (received, or computed here)."""

    async def begin(self, slot: Slot) -> None:
        """Make ``slot``'s sequence ready to decode (its first token known)."""


class DecodeBatch:
    """Reservations, the batch and its steps (see the module docstring) for ``host``'s engine."""

    def __init__(self, host: EngineHost, admission: Admission) -> None:
        self.host, self.admission = host, admission
        self.cfg, self.engine, self.stores, self.run_engine = host.cfg, host.engine, host.stores, host.run_engine
        self.pending: deque[P.DecodeRequest] = deque()  # waiting for room to reserve
        self.incoming: dict[str, Slot] = {}  # reserved, KV arriving
        self.running: dict[str, Slot] = {}
        self.aborted: set[str] = set()  # running requests to retire at the next step
        self.steps: list[tuple[int, int, float]] = []  # (batch, KV tokens, seconds) since the last heartbeat
        self._steps_at = time.monotonic()  # when the last heartbeat took them
        # its own steps' cost, to keep flex work from slowing the others' past the TBT SLO
        profile = host.profile.decode if host.profile is not None else ()
        self.step_cost = DecodeCostModel.from_profile(profile) if profile else DecodeCostModel()
        self.tbt_default_ms = reachable_target_ms(host.profile, self.engine.block_tokens)  # classes with no tbt_slo_ms
        self.wake = asyncio.Event()  # something to step (set by whoever adds work)
        self._reserving = asyncio.Lock()
        self.outlets = TokenOutlets(host.ctx, host.node_id, host.curve)

    def busy(self) -> bool:
        return bool(self.running or self.incoming or self.pending)

    def held_requests(self) -> list[str]:
        return [*(m.req_id for m in self.pending), *self.incoming, *self.running]

    def report(self, load: P.Load) -> None:
        """The batch's share of a heartbeat: its queues, and its steps (``STEPS_PER_S`` at most a
        second: a heartbeat that goes early, with blocks to report, carries its share)."""
        steps, self.steps = self.steps, []
        now, last = time.monotonic(), self._steps_at
        self._steps_at = now
        self.outlets.prune({s.msg.reply_to for s in (*self.running.values(), *self.incoming.values())})
        load.running, load.waiting = len(self.running), len(self.pending) + len(self.incoming)
        load.steps = steps[-max(1, int(STEPS_PER_S * min(1.0, now - last))):]

    async def handle(self, msg: P.Msg) -> None:
        """A ``DecodeRequest``, ``FirstToken`` or ``Abort``."""
        if isinstance(msg, P.DecodeRequest):
            self._enqueue(msg)
            await self.reserve_pending()
        elif isinstance(msg, P.FirstToken):
            slot = self.incoming.get(msg.req_id)
            if slot is not None:
                slot.first_token = msg.token
                await self.maybe_start(slot)
        elif isinstance(msg, P.Abort):
            await self.drop(msg.req_id)
        else:
            log.warning("%s ignores %s", self.host.role, type(msg).__name__)

    async def drop(self, req_id: str) -> None:
        """Forget a request wherever it is (aborted by its frontend or the conductor)."""
        self.pending = deque(m for m in self.pending if m.req_id != req_id)
        slot = self.incoming.pop(req_id, None)
        if slot is not None:
            self.wake.set()  # flex work may have been yielding to its prefill
            await self.run_engine(self.engine.free, slot.seq)
            await self.reserve_pending()
        if req_id in self.running:
            self.aborted.add(req_id)
            self.wake.set()

    # ------------------------------------------------------------ reservations

    async def reserve_pending(self) -> None:
        """Reserve blocks for waiting requests, in order, while the pool has room for them and
        one more block per running sequence (so that reserving never starves the batch). One
        caller at a time; a request dropped while its reservation was being made gives it back."""
        async with self._reserving:
            eng = self.engine
            while self.pending and self.admission.may_reserve(self.pending[0]):
                msg = self.pending[0]
                need = -(-len(msg.tokens) // eng.block_tokens)
                seq = None
                if eng.blocks.num_available() >= need + len(self.running):
                    try:
                        seq = await self.admission.hold(msg)
                    except InvalidRequestError as e:
                        self._unqueue(msg)
                        await self.host.fail(msg.req_id, e)
                        continue
                if not any(m is msg for m in self.pending):  # aborted meanwhile
                    if seq is not None:
                        await self.run_engine(eng.free, seq)
                    continue
                if seq is None:
                    if await self._preempt_for(msg):  # it takes the room of work it goes before
                        continue
                    if not (self.running or self.incoming):  # nothing will free memory: it never fits here
                        self._unqueue(msg)
                        await self.host.fail(msg.req_id, f"its KV ({need} blocks) does not fit in this decode pool")
                        continue
                    return
                self._unqueue(msg)  # a more urgent one may have been queued ahead of it meanwhile
                self.incoming[msg.req_id] = Slot(msg, seq, [0] * eng.block_shape[0], next_index=msg.num_generated + 1,
                                                 stored=msg.store_from_block, reserved_at=time.monotonic())
                await self.host.send(P.Reserved(msg.req_id, self.host.node_id))

    def _enqueue(self, msg: P.DecodeRequest) -> None:
        """Wait for room behind the requests of its class and those before it, ahead of the rest
        (``sched/request_class.py``)."""
        key, i = urgency(msg.sampling), len(self.pending)
        while i and urgency(self.pending[i - 1].sampling) > key:
            i -= 1
        self.pending.insert(i, msg)

    def _unqueue(self, msg: P.DecodeRequest) -> None:
        """Take ``msg`` itself out of the queue (wherever it is now)."""
        self.pending = deque(m for m in self.pending if m is not msg)

    async def maybe_start(self, slot: Slot) -> None:
        """Begin decoding ``slot`` if its first token is known and its KV in (once)."""
        if slot.first_token is None or slot.started or not self.admission.ready(slot):
            return
        slot.started, slot.started_at = True, time.monotonic()
        await self.admission.begin(slot)
        self.join(slot)

    def join(self, slot: Slot) -> None:
        """A sequence whose decoding began joins the batch at the next step (unless dropped meanwhile)."""
        rid = slot.msg.req_id
        if self.incoming.pop(rid, None) is slot:
            self.running[rid] = slot
            self.wake.set()

    async def give_up(self, slot: Slot, why: str, kind: P.FailureKind = P.FailureKind.RETRY) -> None:
        """Free a reserved or running request and report it to its frontend."""
        rid = slot.msg.req_id
        self.incoming.pop(rid, None)
        self.running.pop(rid, None)
        self.wake.set()  # flex work may have been yielding to its prefill
        await self.run_engine(self.engine.free, slot.seq)
        await self.host.fail(rid, why, kind)

    # ------------------------------------------------------------ steps

    async def run(self, step: Callable[[], Awaitable[bool]]) -> None:
        """Run ``step`` (True: it ran something) until cancelled, waiting for work when idle."""
        while True:
            try:
                if not await step():
                    self.wake.clear()
                    await self.wake.wait()
            except Exception as e:  # a step that fails fails its batch, never the role
                log.exception("decode step failed")
                for slot in list(self.running.values()):
                    await self.give_up(slot, f"decode step failed: {type(e).__name__}: {e}")

    async def decode_step(self) -> bool:
        """One decode step of the batch; False when there is nothing to run."""
        slots = await self.prepare_step()
        if not slots:
            return False
        kv_tokens = sum(s.seq.num_tokens for s in slots)
        t0 = time.perf_counter()
        outs = await self.run_engine(self.engine.decode_step, [s.seq for s in slots])
        self.observe_step(len(slots), kv_tokens, time.perf_counter() - t0)
        await self.emit(slots, outs)
        return True

    async def prepare_step(self) -> list[Slot]:
        """Before a step: retire the aborted, reserve for the waiting, make room; the step's batch."""
        for rid in [r for r in self.running if r in self.aborted]:
            await self._retire(self.running.pop(rid), write=False)
        self.aborted.clear()
        await self.reserve_pending()
        if not self.running:
            return []
        await self._make_room()
        return self.batch()

    def observe_step(self, batch: int, kv_tokens: int, seconds: float) -> None:
        step = (batch, kv_tokens, seconds)
        self.steps.append(step)
        self.step_cost.observe(*step)

    async def emit(self, slots: list[Slot], outs: list[StepOutput]) -> None:
        """A step's tokens to their frontends; the finished retire."""
        self.host.progress += 1
        events: dict[str, list[P.TokenEvent]] = {}  # frontend token endpoint -> this step's events for it
        done = []
        for slot, out in zip(slots, outs):
            rid = slot.msg.req_id
            if out.token is None or self.running.get(rid) is not slot:
                continue
            finished = P.FinishReason(out.finished) if out.finished else None
            tokens = out.tokens  # several where a speculative step accepted drafts
            events.setdefault(slot.msg.reply_to, []).append(P.TokenEvent(rid, slot.next_index, tokens, finished,
                                                                         out.logprobs))
            slot.next_index += len(tokens)
            if finished is not None:
                done.append(slot)
        if events:  # the step's tokens in one message per frontend; a request's last token before its retirement
            await self._send_tokens(events)
        for slot in done:  # still running if the send failed: the step's failure gives them up
            if self.running.get(slot.msg.req_id) is slot:
                await self._retire(self.running.pop(slot.msg.req_id), write=True)

    def batch(self) -> list[Slot]:
        """The running sequences this step: every one, except flex work past what keeps the others'
        predicted step within their tightest TBT target and the flex allowance (``request_class``),
        and all flex work while an interactive request reserved here is being prefilled on this
        machine: the prefill gets the cores they share, and its first token comes sooner."""
        slots = list(self.running.values())
        flex = sorted((s for s in slots if rank(s.seq.sampling) == FLEX_RANK),
                      key=lambda s: (urgency(s.seq.sampling), s.seq.uid))
        since = time.monotonic() - YIELD_AT_MOST_S  # a prefill slower than that gets no more
        yielding = flex and any(s.msg.prefill_beside and rank(s.seq.sampling) != FLEX_RANK and s.reserved_at > since
                                for s in self.incoming.values())  # reserved, its prefill beside us
        if not flex or (len(flex) == len(slots) and not yielding):
            return slots
        others = [s for s in slots if rank(s.seq.sampling) != FLEX_RANK]
        if yielding:
            return others
        target_s = tightest_target_ms((s.seq.sampling for s in others), self.cfg, self.tbt_default_ms) / 1000
        kv = sum(s.seq.num_tokens for s in others)
        allowance_s = flex_allowance_s(self.step_cost.predict(len(others), kv), target_s)
        n = flex_joining(len(others), kv, [s.seq.num_tokens for s in flex], self.step_cost.predict, allowance_s)
        return others + flex[:n]

    async def _send_tokens(self, by_frontend: dict[str, list[P.TokenEvent]]) -> None:
        for endpoint, batch in by_frontend.items():
            if endpoint:
                await self.outlets.send(endpoint, batch)
            else:  # no token endpoint named (a bare DecodeRequest, as unit tests send): with the reports
                await self.host.send(batch[0] if len(batch) == 1 else P.TokenStep(batch))

    # ------------------------------------------------------------ preemption, retirement

    async def _make_room(self) -> None:
        """Preempt sequences until the next step's new blocks fit in the pool: flex work first,
        then by ``priority``, the newest of them first (``sched/request_class.py``). Only the
        sequences that step next (``batch``) count: flex work left out of it needs no block."""
        eng = self.engine
        while eng.blocks_needed([s.seq for s in self.batch()]) > eng.blocks.num_available():
            holders = list(self.running.values()) + list(self.incoming.values())
            victim = preemption_victim(holders)
            if len(holders) == 1:
                await self.give_up(victim, "the sequence outgrew this decode instance's whole KV pool")
                return
            await self._preempt(victim)

    async def _preempt_for(self, msg: P.DecodeRequest) -> bool:
        """Make room for ``msg`` by preempting one sequence that yields to it (``yields_to``: flex work
        to interactive work, another tenant's later work in the fair order; the least urgent first)."""
        ours = [s for s in (*self.running.values(), *self.incoming.values()) if yields_to(s.seq.sampling, msg.sampling)]
        need = -(-len(msg.tokens) // self.engine.block_tokens) + len(self.running)
        if not ours or self.engine.blocks.num_available() + sum(len(s.seq.block_table) for s in ours) < need:
            return False  # none to take, or not enough even with all of it
        await self._preempt(preemption_victim(ours))
        return True

    async def _preempt(self, victim: Slot) -> None:
        """Give a sequence back to its frontend for a later attempt (it resumes from what it wrote to the store)."""
        log.info("KV pool full: preempting %s", victim.msg.req_id)
        victim.preempted = True
        if victim.msg.req_id in self.running:
            self.running.pop(victim.msg.req_id)
            await self._retire(victim, write=True)
        else:
            self.incoming.pop(victim.msg.req_id)
            await self.run_engine(self.engine.free, victim.seq)
        await self.host.fail(victim.msg.req_id, "preempted: the decode KV pool is full", P.FailureKind.PREEMPTED)

    async def _retire(self, slot: Slot, write: bool) -> None:
        """Free a sequence; with ``write`` its blocks holding generated tokens go to the store."""
        seq = slot.seq
        trace_slot(self.host.tracer, self.host.role, slot, slot.preempted)  # its spans, if its request is traced
        first_new = len(slot.msg.tokens) // self.engine.block_tokens
        hashes = list(seq.block_hashes)
        if write and slot.msg.store_endpoint and len(hashes) > first_new:
            await self.stores.save_blocks(slot.msg.store_endpoint, seq, hashes[first_new:], first_new, len(hashes))
        await self.run_engine(self.engine.free, seq)


def preemption_victim(holders: list[Slot]) -> Slot:
    """The sequence to preempt first: flex work before default before priority, a higher
    ``priority`` number first, then the newest (``sched/request_class.py``)."""
    return max(holders, key=lambda s: (urgency(s.seq.sampling), s.seq.uid))
