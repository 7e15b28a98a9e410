"""Colocated role: one engine that prefills and decodes, mixing prompt chunks into decode steps.

A frontend drives a colocated attempt as it drives a prefill/decode pair whose two halves are one
instance (``frontend/attempt_driver.py``): ``DecodeRequest`` holds the blocks (the longest cached
prefix attached, the rest allocated; ``Reserved`` when the pool has room, in class order as on
decode), ``PrefillRequest`` brings the plan's store reads and writes, ``PrefillDone`` carries the
first token, ``FirstToken`` lets the sequence join the batch. Nothing moves between the halves:
the KV is computed into the very blocks the sequence decodes from.

Each step is a token for every decoding sequence (``Engine.decode_step``) and then the next
chunks of the prompts being prefilled (``Engine.prefill_many``, interactive prompts first): as many
prompt tokens as keep the step within the tightest TBT target of the classes it decodes, by the
fitted cost of the role's own steps (``sched/colocated_budget.py``: a slow CPU gets small chunks, a GPU
whole ones; a step that overran shrinks the next budget at once), a block at least. Flex decode
rows join a step only while the interactive rows' target holds (the decode role's rule), and flex
prompts' chunks get what the interactive ones leave; a flex prompt never keeps an interactive one
from reserving. The halves are two forwards, not one packed forward: a packed forward
scores every decode row against all the step's keys (rows x all keys, where a decode row needs
only its own) and leaves the decode kernels unused; on the served trace at twice its rate its ITL
p99 was 848 ms against 211 ms for two forwards (BENCHMARKS.md section 24), reading the weights
twice costing a fraction of that. A prompt that fails in its half fails alone. With nothing
decoding, prompts take whole ``prefill_chunk_tokens`` chunks; ``[engine] step_tokens`` fixes the
step's tokens instead. At most ``max_prefill_batch`` prompts of a class hold blocks before they are
computed. Everything else (reservations, the batch, preemption, retiring, tokens
straight to the frontends) is the decode role's ``DecodeBatch`` (``decode_batch.py``), to which this
role is the ``Admission``; the store reads and writes are the prefill role's (``kv/prefill_kv.py``),
without a KV hand-off.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.config import Config
from mooncake.engine import Sequence
from mooncake.engine.sequence import PrefillStep
from mooncake.kv.ingress import Slot
from mooncake.kv.prefill_kv import PrefillKV
from mooncake.kv.prefix_load import PrefixLoader
from mooncake.protocol.engine_profile import EngineProfile
from mooncake.roles.decode_batch import DecodeBatch
from mooncake.roles.engine_host import EngineHost
from mooncake.roles.prefill_inflight import InflightBlocks
from mooncake.sched.colocated_budget import StepBudget
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.request_class import FLEX_RANK, flex_allowance_s, rank, tbt_target_ms, tightest_target_ms, urgency
from mooncake.tracing import span

log = logging.getLogger(__name__)


def step_budget(cfg: Config, profile: EngineProfile | None, decode: DecodeCostModel) -> StepBudget:
    """The role's prompt budget per step (``sched/colocated_budget.py``): its decode steps' model
    (``decode``, the one its flex decisions use) and a prompt model from the start-up profile."""
    prefill = PrefillCostModel.from_profile(profile.prefill, chunk_tokens=profile.chunk_tokens) \
        if profile is not None and profile.prefill else PrefillCostModel(chunk_tokens=cfg.engine.prefill_chunk_tokens)
    return StepBudget(decode, prefill, cfg.engine.prefill_chunk_tokens, cfg.engine.block_tokens)


class _Gone(Exception):
    """The request left while its prompt waited for a step (aborted or preempted)."""


class ColocatedWorker:
    """The colocated role (an ``EngineRole``): an ``EngineHost``, its ``DecodeBatch`` (this role is
    its ``Admission``) and the prompts computed a chunk a step."""

    role = "colocated"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        host = self.host = EngineHost(cfg, self.role)
        self.engine, self.run_engine, self.tracer, self.node_id = host.engine, host.run_engine, host.tracer, host.node_id
        self.batch = DecodeBatch(host, self)
        host.step_tokens = min(cfg.engine.step_tokens, cfg.engine.prefill_chunk_tokens)  # fixed, if configured
        self.budget = step_budget(cfg, host.profile, self.batch.step_cost)
        # what the conductor predicts this instance's steps by: the default class's target
        host.step_target_ms = tbt_target_ms(P.Sampling(), cfg, self.batch.tbt_default_ms)
        self.prompts: dict[str, tuple[Slot, asyncio.Future[PrefillStep]]] = {}  # waiting for their next chunk
        self.inflight = InflightBlocks()  # prompt blocks the prompts here are computing
        self.prefilling: set[str] = set()  # requests whose prompt is being prefilled here
        self.loader = PrefixLoader(self.engine, lambda fn, *args: self.run_engine(fn, *args), host.stores,
                                   host.rejections, self._chunk)
        if host.step_tokens:
            log.info("colocated: %d tokens per step while decoding ([engine] step_tokens)", host.step_tokens)
        else:
            log.info("colocated: prompt tokens per step keep interactive steps within %.0f ms", host.step_target_ms)

    async def start(self) -> None:
        if self.engine.prefix_caching:
            self.host.publish_device_cache()
        self.host.tasks.append(asyncio.create_task(self.batch.run(self._step)))
        await self.host.serve(self, {})

    # ------------------------------------------------------------ EngineRole

    def busy(self) -> bool:
        return self.batch.busy() or bool(self.prompts)

    def held_requests(self) -> list[str]:
        return self.batch.held_requests()

    def load(self) -> P.Load:
        load = self.host.load(pending=bool(self.batch.batch()) or bool(self.prompts))
        self.batch.report(load)
        return load

    async def handle(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        if isinstance(msg, P.PrefillRequest):
            tasks = self.host.tasks
            tasks[:] = [t for t in tasks if not t.done()]
            tasks.append(asyncio.create_task(self._prefill(msg)))
        else:
            await self.batch.handle(msg)

    async def close(self) -> None:
        self.batch.outlets.close()
        await self.host.close()

    # ------------------------------------------------------------ Admission

    async def hold(self, msg: P.DecodeRequest) -> Sequence | None:
        """The longest cached prefix attached and blocks for the rest, which this instance computes."""
        return await self.run_engine(self.engine.add_sequence, msg.req_id, msg.tokens, msg.sampling, None,
                                     msg.num_generated, [BlockHash(h) for h in msg.hashes], BlockHash(msg.root))

    def may_reserve(self, msg: P.DecodeRequest) -> bool:
        """At most ``max_prefill_batch`` prompts at least as urgent as ``msg`` (``urgency``: class,
        priority, the tenants' fair order) hold their blocks before they are computed: the others
        wait unreserved, leaving the pool to the running batch and the prefix cache (a burst
        reserving the whole pool would evict the cached prefixes the burst is about to reuse, and
        leave no room to import those the stores hold). Less urgent prompts never keep one from
        reserving: flex ones an interactive one, a tenant's burst another tenant's request."""
        key = urgency(msg.sampling)
        ahead = sum(not s.seq.prefilled and urgency(s.seq.sampling) <= key for s in self.batch.incoming.values())
        return ahead < self.cfg.engine.max_prefill_batch

    def ready(self, slot: Slot) -> bool:
        return slot.seq.prefilled

    async def begin(self, slot: Slot) -> None:
        """Nothing to do: its first token is in the sequence (the prefill sampled it)."""

    # ------------------------------------------------------------ prefill, one chunk per step

    async def _prefill(self, req: P.PrefillRequest) -> None:
        slot = self.batch.incoming.get(req.req_id)
        if slot is None or slot.seq.prefilled or req.req_id in self.prefilling:
            return  # dropped meanwhile, or a duplicate order
        self.prefilling.add(req.req_id)
        try:
            with span(self.tracer if req.trace else None, "colocated.prefill", req.trace, {
                    "mooncake.request_id": req.req_id, "mooncake.prompt_tokens": len(req.tokens)}):
                await self._compute(req, slot)
        except _Gone:
            log.debug("prefill of %s stopped: the request left", req.req_id)
        except Exception as e:  # report, never die
            if self.batch.incoming.get(req.req_id) is slot:
                log.exception("prefill of %s failed", req.req_id)
                await self.batch.give_up(slot, f"prefill failed: {type(e).__name__}: {e}")
        finally:
            self.prefilling.discard(req.req_id)

    async def _compute(self, req: P.PrefillRequest, slot: Slot) -> None:
        """The store reads the plan names, the chunks (each in a step), the store writes, the first token."""
        eng, T = self.engine, self.engine.block_tokens
        hashes = [BlockHash(h) for h in req.hashes]
        kv = PrefillKV(req, hashes, eng, self.loader, self._no_hand_off, self.host.stores, 1, layer_load=False)
        fetched, fetch_s = await kv.start_load(slot.seq.num_cached_tokens // T)
        if fetched:  # the fetched blocks are in the device cache now: the sequence attaches them
            await self._attach_again(slot)
        if eng.prefix_caching:  # blocks a prompt running here computes: wait for them, compute them once
            while (computing := self.inflight.computing(hashes, slot.seq.num_cached_tokens // T)) is not None:
                await computing.wait()
                await self._attach_again(slot)
            self.inflight.start(req.req_id, hashes, slot.seq.num_cached_tokens // T)
        try:
            seq = slot.seq
            kv.keep_local(seq)
            cached = seq.num_cached_tokens
            compute_s = 0.0
            while True:  # nothing awaited between chunks: the next is asked for before the next step
                step = await self._chunk(seq)
                self._check(slot)
                compute_s += step.compute_s
                if step.done:
                    break
        finally:
            self.inflight.finish(req.req_id)  # its blocks are cached: those waiting for them go on
        finished = P.FinishReason(step.finished) if step.finished else None
        await self.host.send(P.PrefillDone(req.req_id, self.node_id, int(step.token), cached_tokens=cached,  # type: ignore[arg-type]
                                      computed_tokens=len(req.tokens) - cached, prefill_s=compute_s,
                                      fetched_blocks=fetched, fetch_s=fetch_s, finished=finished,
                                      logprob=step.logprob))
        await kv.save_to_store(kv.store_start(cached // T), len(kv.hashes))  # nothing moves to a decode: all at once
        await self.batch.maybe_start(slot)  # if its FirstToken came already

    async def _attach_again(self, slot: Slot) -> None:
        """``slot``'s sequence again, attaching the blocks imported or computed for it meanwhile
        (``_reattach``); the new one is freed if the request left while it was made."""
        self._check(slot)
        again = await self.run_engine(self._reattach, slot.seq)
        if self.batch.incoming.get(slot.msg.req_id) is not slot:
            await self.run_engine(self.engine.free, again)
            raise _Gone()
        slot.seq = again

    def _reattach(self, seq: Sequence) -> Sequence:
        """Engine thread: ``seq`` again, now attaching the blocks imported or computed for it
        meanwhile (none of its own computed yet, so nothing is lost; the blocks it frees cover the
        new allocation)."""
        self.engine.free(seq)
        again = self.engine.add_sequence(seq.req_id, seq.tokens, seq.sampling, None, seq.num_generated, seq.hashes,
                                         seq.root)
        if again is None:
            raise RuntimeError("the KV pool lost room while a prefix was imported")
        return again

    def _check(self, slot: Slot) -> None:
        if self.batch.incoming.get(slot.msg.req_id) is not slot:
            raise _Gone()

    async def _chunk(self, seq: Sequence, on_layer: object = None) -> PrefillStep:
        """The next chunk of ``seq``, computed in the next step."""
        slot = self.batch.incoming.get(seq.req_id)
        if slot is None or slot.seq is not seq:
            raise _Gone()
        fut: asyncio.Future[PrefillStep] = asyncio.get_running_loop().create_future()
        self.prompts[seq.req_id] = (slot, fut)
        self.batch.wake.set()
        try:
            return await fut
        finally:
            if self.prompts.get(seq.req_id, (None, None))[1] is fut:
                del self.prompts[seq.req_id]

    async def _no_hand_off(self, endpoint: str, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        raise AssertionError("a colocated instance hands no KV off")

    # ------------------------------------------------------------ the mixed step

    async def _step(self) -> bool:
        slots = await self.batch.prepare_step()
        await asyncio.sleep(0)  # the prompts whose chunk the last step computed ask for their next one
        prompts = []
        for rid, (slot, fut) in list(self.prompts.items()):
            if fut.done():
                continue
            if self.batch.incoming.get(rid) is not slot or slot.seq.freed:
                fut.set_exception(_Gone())
            else:
                prompts.append((slot, fut))
        if not slots and not prompts:
            return False
        # interactive prompts' chunks first: flex ones get what they leave of the budget
        prompts.sort(key=lambda p: (urgency(p[0].seq.sampling), p[0].reserved_at))
        kv_tokens = sum(s.seq.num_tokens for s in slots)
        decode_s = 0.0
        outs = []
        if slots:  # the decode half first: a prompt that fails below fails alone
            t0 = time.perf_counter()
            outs = await self.run_engine(self.engine.decode_step, [s.seq for s in slots])
            decode_s = time.perf_counter() - t0
        budget = self._prompt_budget(slots, kv_tokens, [p[0].seq for p in prompts]) if prompts else 0
        if not slots and not budget:
            return False  # flex prompts wait for the sequence about to join: its first step
        if budget:  # none: flex prompts wait for a step that interactive rows do not need
            seqs = [p[0].seq for p in prompts]
            before = [s.num_computed for s in seqs]
            t0 = time.perf_counter()
            try:
                steps = await self.run_engine(self._prefill_live, seqs, budget)
            except Exception as e:
                steps = [e] * len(prompts)  # _prefill gives each request up
            computed = sum(s.num_computed - b for s, b in zip(seqs, before))
            self.budget.observe(len(slots), kv_tokens, decode_s, computed, before[0], time.perf_counter() - t0)
            for (_, fut), step in zip(prompts, steps):
                if fut.done():
                    continue
                if isinstance(step, BaseException):
                    fut.set_exception(step)
                else:
                    fut.set_result(step)
        if slots:
            self.batch.observe_step(len(slots), kv_tokens, decode_s)
            await self.batch.emit(slots, outs)
        else:
            self.host.progress += 1
        return True

    def _prefill_live(self, seqs: list[Sequence], budget: int) -> list[PrefillStep | BaseException]:
        """Engine thread: the next chunks of those of ``seqs`` still waiting for them (a sequence
        preempted or dropped since the step began gets ``_Gone``, the others compute)."""
        live = [s for s in seqs if not s.freed and not s.prefilled]
        steps = dict(zip(map(id, live), self.engine.prefill_many(live, None, budget))) if live else {}
        return [_Gone() if (step := steps.get(id(s))) is None else step for s in seqs]

    def _prompt_budget(self, slots: list[Slot], kv_tokens: int, prompts: list[Sequence]) -> int:
        """Prompt tokens for this step (``prompts``: interactive first). While sequences decode (or one is
        about to join): what keeps the step within the tightest TBT target of their classes
        (``sched/colocated_budget.py``), a block at least; else a whole chunk. Flex prompts get what the
        flex allowance of the step's interactive work (rows and prompts' chunks) leaves
        (``request_class.flex_allowance_s``; maybe nothing: they wait for a step interactive work does
        not need), and flex work alone ``[classes] flex_chunk_tokens`` (an interactive prompt that
        arrives waits behind that much at most). ``[engine] step_tokens``, where set, fixes it instead."""
        joining = [s for s in self.batch.incoming.values() if s.seq.prefilled]  # done, about to decode
        rows, chunk = slots + joining, self.cfg.engine.prefill_chunk_tokens
        if self.host.step_tokens:
            return max(self.engine.block_tokens, self.host.step_tokens - len(rows)) if rows else chunk
        kv = kv_tokens + sum(s.seq.num_tokens for s in joining)
        target_s = tightest_target_ms((s.seq.sampling for s in rows), self.cfg, self.batch.tbt_default_ms) / 1000
        ctx = prompts[0].num_computed
        budget = self.budget.tokens(len(rows), kv, ctx, target_s) if rows else chunk
        if rank(prompts[-1].sampling) != FLEX_RANK:
            return budget  # no flex prompt here
        interactive = [s for s in rows if rank(s.seq.sampling) != FLEX_RANK]
        ahead = min(budget, sum(len(p.tokens) - p.num_computed for p in prompts if rank(p.sampling) != FLEX_RANK))
        if not interactive and not ahead:  # flex work alone
            return min(budget, self.cfg.classes.flex_chunk_tokens or chunk)
        own_s = self.budget.decode.predict(len(interactive), sum(s.seq.num_tokens for s in interactive)) \
            if interactive else 0.0
        own_s += self.budget.prefill.predict(ahead, ctx) if ahead else 0.0
        flex = self.budget.tokens(len(rows), kv, ctx, flex_allowance_s(own_s, target_s), least=0)
        return max(ahead, flex)  # the interactive prompts' chunks, then what the allowance leaves flex ones
