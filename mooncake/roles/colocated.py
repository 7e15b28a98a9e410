"""Colocated role: one engine that prefills and decodes, mixing prompt chunks into decode steps.

A frontend drives a colocated attempt as it drives a prefill/decode pair whose two halves are one
instance (``frontend/attempt_driver.py``): ``DecodeRequest`` holds the blocks (the longest cached
prefix attached, the rest allocated; ``Reserved`` when the pool has room, in class order as on
decode), ``PrefillRequest`` brings the plan's store reads and writes, ``PrefillDone`` carries the
first token, ``FirstToken`` lets the sequence join the batch. Nothing moves between the halves:
the KV is computed into the very blocks the sequence decodes from.

Each step is a token for every decoding sequence (``Engine.decode_step``) and then the next
chunks of the prompts being prefilled (``Engine.prefill_many``), within ``step_tokens`` tokens in
all (Sarathi-Serve's stall-free batching: a token waits behind at most that many prompt tokens,
never a whole prompt). The halves are two forwards, not one packed forward: a packed forward
scores every decode row against all the step's keys (rows x all keys, where a decode row needs
only its own) and leaves the decode kernels unused; on the served trace at twice its rate its ITL
p99 was 848 ms against 211 ms for two forwards (BENCHMARKS.md section 24), reading the weights
twice costing a fraction of that. A prompt that fails in its half fails alone. With nothing decoding, prompts take whole ``prefill_chunk_tokens`` chunks. ``step_tokens``
comes from ``[engine] step_tokens``, else from the start-up profile and the TBT SLO
(``step_budget``). At most ``max_prefill_batch`` prompts hold blocks before they are computed. Everything else (reservations, the batch, preemption, retiring, tokens
straight to the frontends) is the decode role's; the store reads and writes are the prefill
role's (``kv/prefill_kv.py``), without a KV hand-off.
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
from mooncake.roles.decode import DecodeWorker
from mooncake.roles.prefill_inflight import InflightBlocks
from mooncake.sched.colocated import DEFAULT_STEP_TOKENS, TYPICAL_BATCH, TYPICAL_CTX, fit_step_tokens
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.request_class import urgency

log = logging.getLogger(__name__)


def step_budget(cfg: Config, profile: EngineProfile | None) -> int:
    """Tokens per mixed step: ``[engine] step_tokens``, else the most (in blocks) whose prompt chunk
    keeps a step of ``TYPICAL_BATCH`` sequences within ``[conductor] tbt_slo_ms`` by the start-up
    profile, else ``DEFAULT_STEP_TOKENS``; never more than ``prefill_chunk_tokens``."""
    chunk = cfg.engine.prefill_chunk_tokens
    if cfg.engine.step_tokens:
        return min(cfg.engine.step_tokens, chunk)
    slo_s = cfg.conductor.tbt_slo_ms / 1000
    if not slo_s or profile is None or not profile.prefill or not profile.decode:
        return min(DEFAULT_STEP_TOKENS, chunk)
    prefill = PrefillCostModel.from_profile(profile.prefill, chunk_tokens=profile.chunk_tokens)
    decode_s = DecodeCostModel.from_profile(profile.decode).predict(TYPICAL_BATCH, TYPICAL_BATCH * TYPICAL_CTX)
    return fit_step_tokens(lambda n: decode_s + prefill.predict(n, TYPICAL_CTX), slo_s, chunk, cfg.engine.block_tokens)


class _Gone(Exception):
    """The request left while its prompt waited for a step (aborted or preempted)."""


class ColocatedWorker(DecodeWorker):
    role = "colocated"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.step_tokens = step_budget(cfg, self._profile)
        self.prompts: dict[str, tuple[Slot, asyncio.Future[PrefillStep]]] = {}  # waiting for their next chunk
        self.inflight = InflightBlocks()  # prompt blocks the prompts here are computing
        self.prefilling: set[str] = set()  # requests whose prompt is being prefilled here
        self.loader = PrefixLoader(self.engine, lambda fn, *args: self.run_engine(fn, *args), self.stores,
                                   self.rejections, self._chunk)
        log.info("colocated: %d tokens per step while decoding", self.step_tokens)

    async def start(self) -> None:
        if self.engine.prefix_caching:
            self.publish_device_cache()
        self._tasks.append(asyncio.create_task(self._step_loop()))
        await self.serve({})

    def busy(self) -> bool:
        return super().busy() or bool(self.prompts)

    def load(self) -> P.Load:
        load = super().load()
        load.pending = load.pending or bool(self.prompts)
        return load

    async def handle(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        if isinstance(msg, P.PrefillRequest):
            self._tasks = [t for t in self._tasks if not t.done()]
            self._tasks.append(asyncio.create_task(self._prefill(msg)))
        else:
            await super().handle(msg, tensors)

    async def _hold(self, msg: P.DecodeRequest) -> Sequence | None:
        """The longest cached prefix attached and blocks for the rest, which this instance computes."""
        return await self.run_engine(self.engine.add_sequence, msg.req_id, msg.tokens, msg.sampling, None,
                                     msg.num_generated, [BlockHash(h) for h in msg.hashes], BlockHash(msg.root))

    def _may_reserve(self) -> bool:
        """At most ``max_prefill_batch`` prompts hold their blocks before they are computed: the
        others wait unreserved, leaving the pool to the running batch and the prefix cache (a
        burst reserving the whole pool would evict the cached prefixes the burst is about to reuse,
        and leave no room to import those the stores hold)."""
        return sum(not s.seq.prefilled for s in self.incoming.values()) < self.cfg.engine.max_prefill_batch

    async def _maybe_start(self, slot: Slot) -> None:
        if slot.first_token is None or not slot.seq.prefilled or slot.started:
            return
        slot.started = True  # its first token is in the sequence already (the prefill sampled it)
        self._join(slot)

    # ------------------------------------------------------------ prefill, one chunk per step

    async def _prefill(self, req: P.PrefillRequest) -> None:
        slot = self.incoming.get(req.req_id)
        if slot is None or slot.seq.prefilled or req.req_id in self.prefilling:
            return  # dropped meanwhile, or a duplicate order
        self.prefilling.add(req.req_id)
        try:
            await self._compute(req, slot)
        except _Gone:
            log.debug("prefill of %s stopped: the request left", req.req_id)
        except Exception as e:  # report, never die
            if self.incoming.get(req.req_id) is slot:
                log.exception("prefill of %s failed", req.req_id)
                await self._give_up(slot, f"prefill failed: {type(e).__name__}: {e}")
        finally:
            self.prefilling.discard(req.req_id)

    async def _compute(self, req: P.PrefillRequest, slot: Slot) -> None:
        """The store reads the plan names, the chunks (each in a step), the store writes, the first token."""
        eng, T = self.engine, self.engine.block_tokens
        hashes = [BlockHash(h) for h in req.hashes]
        kv = PrefillKV(req, hashes, eng, self.loader, self._no_hand_off, self.stores, 1, layer_load=False)
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
        await self.send(P.PrefillDone(req.req_id, self.node_id, int(step.token), cached_tokens=cached,  # type: ignore[arg-type]
                                      computed_tokens=len(req.tokens) - cached, prefill_s=compute_s,
                                      fetched_blocks=fetched, fetch_s=fetch_s, finished=finished,
                                      logprob=step.logprob))
        await kv.save_to_store(kv.store_start(cached // T), len(kv.hashes))  # nothing moves to a decode: all at once
        await self._maybe_start(slot)  # if its FirstToken came already

    async def _attach_again(self, slot: Slot) -> None:
        """``slot``'s sequence again, attaching the blocks imported or computed for it meanwhile
        (``_reattach``); the new one is freed if the request left while it was made."""
        self._check(slot)
        again = await self.run_engine(self._reattach, slot.seq)
        if self.incoming.get(slot.msg.req_id) is not slot:
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
        if self.incoming.get(slot.msg.req_id) is not slot:
            raise _Gone()

    async def _chunk(self, seq: Sequence, on_layer: object = None) -> PrefillStep:
        """The next chunk of ``seq``, computed in the next step."""
        slot = self.incoming.get(seq.req_id)
        if slot is None or slot.seq is not seq:
            raise _Gone()
        fut: asyncio.Future[PrefillStep] = asyncio.get_running_loop().create_future()
        self.prompts[seq.req_id] = (slot, fut)
        self._wake.set()
        try:
            return await fut
        finally:
            if self.prompts.get(seq.req_id, (None, None))[1] is fut:
                del self.prompts[seq.req_id]

    async def _no_hand_off(self, endpoint: str, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        raise AssertionError("a colocated instance hands no KV off")

    # ------------------------------------------------------------ the mixed step

    async def _step(self) -> bool:
        slots = await self._prepare_step()
        await asyncio.sleep(0)  # the prompts whose chunk the last step computed ask for their next one
        prompts = []
        for rid, (slot, fut) in list(self.prompts.items()):
            if fut.done():
                continue
            if self.incoming.get(rid) is not slot or slot.seq.freed:
                fut.set_exception(_Gone())
            else:
                prompts.append((slot, fut))
        if not slots and not prompts:
            return False
        prompts.sort(key=lambda p: (urgency(p[0].seq.sampling), p[0].reserved_at))
        # whole chunks only while nothing decodes or waits to (a prompt done is about to join)
        joining = any(s.seq.prefilled for s in self.incoming.values())
        budget = self.step_tokens if slots or joining else self.cfg.engine.prefill_chunk_tokens
        outs = []
        if slots:  # the decode half first: a prompt that fails below fails alone
            kv_tokens = sum(s.seq.num_tokens for s in slots)
            t0 = time.perf_counter()
            outs = await self.run_engine(self.engine.decode_step, [s.seq for s in slots])
            self._observe_step(len(slots), kv_tokens, time.perf_counter() - t0)
        if prompts:
            left = max(self.engine.block_tokens, budget - len(slots))  # a prompt always moves by a block
            try:
                steps = await self.run_engine(self.engine.prefill_many, [p[0].seq for p in prompts], None, left)
            except Exception as e:
                steps = [e] * len(prompts)  # _prefill gives each request up
            for (_, fut), step in zip(prompts, steps):
                if fut.done():
                    continue
                if isinstance(step, Exception):
                    fut.set_exception(step)
                else:
                    fut.set_result(step)
        if slots:
            await self._emit(slots, outs)
        else:
            self.progress += 1
        return True
