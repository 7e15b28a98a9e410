"""Prefill role: reuse the longest prefix, compute the rest in chunks, ship KV to decode.

Per request: blocks already in this instance's device cache are attached; the
conductor's fetch plan names stores holding the next blocks (local node first)
and they are imported; the rest is computed chunk by chunk. New KV leaves for the decode instance
layer by layer as the engine computes it (``[engine] kv_transfer = "layer"``, see
``mooncake/kv/layers.py``), or block by block after each chunk (``"block"``), while
later work computes. The first token goes to the frontend driving the attempt; each chunk's newly
completed full blocks are written to the node's store in the background. Every KV
movement goes through the request's connector (``mooncake/kv/prefill_kv.py``).

Trust: blocks read from a store must be the ones asked for, in the model's block
shape and dtype (else a miss, recomputed: ``mooncake/kv/prefix_load.py``); every KV transfer
to decode carries the attempt's token (from its route) and a checksum per block.

A request with a ``StagePlan`` runs this instance as one stage of a pipeline group
(``prefill_stage.py``): the same prefix handling and KV path, its own layers only.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
import zmq.asyncio

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.config import Config
from mooncake.engine import Sequence
from mooncake.kv.egress import KVEgress
from mooncake.kv.link import bind_kv_ingress
from mooncake.kv.prefill_kv import PrefillKV
from mooncake.kv.prefix_load import PrefixLoader
from mooncake.roles.class_queue import ClassQueue, TenantSlots, next_to_start
from mooncake.roles.engine_host import EngineHost
from mooncake.roles.engine_thread import ENGINE_URGENCY
from mooncake.roles.prefill_batcher import PrefillBatcher
from mooncake.roles.prefill_inflight import InflightBlocks
from mooncake.roles.prefill_stage import ActivationInbox, run_stage
from mooncake.sched.request_class import FLEX_RANK, rank, tenant_urgency
from mooncake.sockets import recv_multipart
from mooncake.tracing import record_span, span

log = logging.getLogger(__name__)


class PrefillWorker:
    """The prefill role (an ``EngineRole``) on its ``EngineHost``."""

    role = "prefill"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        host = self.host = EngineHost(cfg, self.role)
        self.engine, self.run_engine, self.tracer, self.node_id = host.engine, host.run_engine, host.tracer, host.node_id
        # Interactive and flex work queue apart (each by class, then arrival), and each runs up to
        # max_prefill_batch prompts at once: an interactive request never waits for a place flex holds.
        self.queues: dict[bool, ClassQueue[P.PrefillRequest]] = {False: ClassQueue(), True: ClassQueue()}  # flex?
        self.aborted: set[str] = set()
        self.queued: set[str] = set()  # ids in ``queue``: an Abort for anything else is stale
        self.running: set[str] = set()  # requests being prefilled (their chunks batch together)
        self._slots = {flex: TenantSlots(cfg.engine.max_prefill_batch) for flex in self.queues}
        self._holding = 0  # requests holding a sequence (blocks) in the engine
        self._released = asyncio.Event()  # set when one of them frees its blocks
        self._releases = 0  # how many have (a failed allocation retries if one did meanwhile)
        self.inflight = InflightBlocks()  # prompt blocks the running requests are computing
        self.chunks = PrefillBatcher(lambda seqs, hooks, budget: self.run_engine(
            self.engine.prefill_many, seqs, hooks, budget, urgency=min(tenant_urgency(s.sampling) for s in seqs)),
            cfg.engine.prefill_chunk_tokens,
            min(cfg.classes.flex_chunk_tokens or cfg.engine.prefill_chunk_tokens, cfg.engine.prefill_chunk_tokens))
        self.egress = KVEgress(host.ctx, host.curve, self.aborted)  # KV (and activations) to other instances
        self.loader = PrefixLoader(self.engine, lambda fn, *args: self.run_engine(fn, *args), host.stores,
                                   host.rejections, self.chunks.chunk)
        self.inbox = ActivationInbox(lambda rid: rid in self.running or rid in self.queued)  # pipeline stages: hidden states from the previous stage
        self._act_sock: zmq.asyncio.Socket | None = None
        self._arrived: dict[str, float] = {}  # traced requests queued: when they came (their span's queue wait)

    async def start(self) -> None:
        host = self.host
        if self.engine.prefix_caching:
            host.publish_device_cache()
        host.tasks += [asyncio.create_task(self._work_loop(flex)) for flex in self.queues]
        endpoints = {}
        if self.cfg.conductor.cpp_group_size > 1:  # this instance may be a pipeline stage
            self._act_sock, endpoints["act"] = bind_kv_ingress(host.ctx, host.curve, self.cfg.node.host, 0,
                                                               host.max_message_bytes)
            host.tasks.append(asyncio.create_task(self._activation_loop()))
        await host.serve(self, endpoints)

    async def _activation_loop(self) -> None:
        assert self._act_sock is not None
        while True:
            frames = await recv_multipart(self._act_sock)
            try:
                self.inbox.on_frames(frames, self.host.curve)
            except Exception:  # one bad message never stops the ingress
                log.exception("error handling activations")

    def busy(self) -> bool:
        return bool(self.running) or not all(q.empty() for q in self.queues.values())

    def load(self) -> P.Load:
        load = self.host.load(pending=self.busy())
        load.waiting, load.running = sum(q.qsize() for q in self.queues.values()), len(self.running)
        return load

    async def handle(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        if isinstance(msg, P.PrefillRequest):
            self.aborted.discard(msg.req_id)
            self.queued.add(msg.req_id)
            if msg.trace and self.tracer is not None and len(self._arrived) < 4096:
                self._arrived[msg.req_id] = time.monotonic()
            self.queues[rank(msg.sampling) == FLEX_RANK].put_nowait(msg)
        elif isinstance(msg, P.Abort):
            if msg.req_id in self.running or msg.req_id in self.queued:
                self.aborted.add(msg.req_id)
        else:
            log.warning("prefill ignores %s", type(msg).__name__)

    def held_requests(self) -> list[str]:
        return [*self.queued, *self.running]

    async def _work_loop(self, flex: bool) -> None:
        """Up to ``max_prefill_batch`` requests of interactive classes (or, ``flex``, of flex work)
        at once (and one more of a tenant with none running), by class, priority, the tenants' fair
        order, then arrival; the chunks of all that run batch (``prefill_batcher.py``)."""
        queue, slots = self.queues[flex], self._slots[flex]
        while True:
            req = await next_to_start(queue, slots)
            self.queued.discard(req.req_id)
            if req.req_id in self.aborted:
                self.aborted.discard(req.req_id)
                continue
            slots.take(req.sampling.tenant)
            self.running.add(req.req_id)
            tasks = self.host.tasks
            tasks.append(asyncio.create_task(self._run_one(req, slots)))
            tasks[:] = [t for t in tasks if not t.done()]

    async def _run_one(self, req: P.PrefillRequest, slots: TenantSlots) -> None:
        key = tenant_urgency(req.sampling)
        ENGINE_URGENCY.set(key)  # this task's engine calls (and its tasks') go by its class, priority, fair order
        try:
            arrived = self._arrived.pop(req.req_id, None)
            with self.host.pool.expecting(key), span(self.tracer if arrived else None, "prefill.request", req.trace, {
                    "mooncake.request_id": req.req_id, "mooncake.request_class": req.sampling.request_class,
                    "mooncake.prompt_tokens": len(req.tokens)}):
                if arrived:
                    record_span(self.tracer, "prefill.queue_wait", arrived, time.monotonic())
                await self._prefill(req)
        except Exception as e:  # report, never die
            if req.req_id in self.aborted:
                log.info("prefill of %s stopped: aborted", req.req_id)
                return
            log.exception("prefill of %s failed", req.req_id)
            await self.host.fail(req.req_id, e)
        finally:
            self.running.discard(req.req_id)
            self.aborted.discard(req.req_id)
            self.inbox.drop(req.req_id)
            slots.release(req.sampling.tenant)

    def layer_frame_blocks(self) -> int:
        """Blocks of one layer per ``KVLayer`` frame: well under the receiver's message limit."""
        return self.host.max_message_bytes // 2 // (self.engine.kv_block_bytes // self.engine.block_shape[0])

    def _progressed(self) -> None:
        self.host.progress += 1

    async def _prefill(self, req: P.PrefillRequest) -> None:
        eng = self.engine
        t_start = time.perf_counter()
        hashes = [BlockHash(h) for h in req.hashes]
        have = await self.run_engine(eng.cached_prefix, hashes)
        if req.stage is None and eng.prefix_caching:  # blocks a running request computes: wait, compute once
            while (computing := self.inflight.computing(hashes, have)) is not None:
                with self.host.pool.waiting_on_others():
                    await computing.wait()
                have = await self.run_engine(eng.cached_prefix, hashes)
            self.inflight.start(req.req_id, hashes, have)
        try:
            await self._prefill_from(req, hashes, have, t_start)
        finally:
            self.inflight.finish(req.req_id)

    async def _prefill_from(self, req: P.PrefillRequest, hashes: list[BlockHash], have: int, t_start: float) -> None:
        """The prefill of ``req`` once its first ``have`` blocks are in the device cache."""
        eng = self.engine
        kv = PrefillKV(req, hashes, eng, self.loader, self.egress.ship, self.host.stores, self.layer_frame_blocks(),
                       self.cfg.engine.kv_load == "layer")
        with span(self.tracer if req.trace else None, "prefill.prefix_load", attrs={"mooncake.device_blocks": have}) as s:
            fetched, fetch_s = await kv.start_load(have)
            if s is not None:
                s.set_attribute("mooncake.store_blocks", fetched)
        try:
            while True:
                releases = self._releases
                seq: Sequence | None = await self.run_engine(
                    eng.add_sequence, req.req_id, req.tokens, req.sampling, None, req.num_generated, hashes,
                    BlockHash(req.root), req.stage.prefix_blocks if req.stage is not None else None)
                if seq is not None or (not self._holding and releases == self._releases):
                    break
                if releases == self._releases:  # the pool is full of others' prompts: wait for one to end
                    with self.host.pool.waiting_on_others():
                        await self._released.wait()
        except BaseException:  # an invalid request, an abort: the stream goes too
            await kv.close()
            raise
        if seq is None:
            await kv.close()
            await self.host.fail(req.req_id, "the prompt does not fit in this instance's KV pool")
            return
        self._holding += 1
        try:
            if req.stage is not None:
                await kv.attach(seq, have)
                await run_stage(req, seq, kv, fetched, fetch_s, engine=eng, run_engine=self.run_engine,
                                ship=self.egress.ship, inbox=self.inbox, aborted=self.aborted, report=self.host.send,
                                node_id=self.node_id, progressed=self._progressed)
            else:
                await self._compute_and_ship(req, seq, kv, fetched, fetch_s, t_start, have)
        finally:
            await kv.close()
            await self.run_engine(eng.free, seq)
            self._holding -= 1
            self._releases += 1
            self._released.set()  # wake those waiting for blocks; later waits use a fresh event
            self._released = asyncio.Event()

    async def _compute_and_ship(self, req: P.PrefillRequest, seq: Sequence, kv: PrefillKV, fetched: int,
                                fetch_s: float, t_start: float, have: int) -> None:
        """The chunk loop. KV leaves through ``kv`` while later work computes: the reused prefix
        first (known before any compute; a prefix streaming from a store layer by layer once it is
        verified), then each layer of each chunk as soon as it is computed
        (``kv_transfer = "layer"``) or each chunk's blocks after the chunk. The blocks a chunk
        completes are written to the store after that chunk."""
        eng = self.engine
        T = eng.block_tokens
        sent = seq.num_cached_tokens // T
        loading = await kv.attach(seq, have)
        on_layer = kv.save_layer if self.cfg.engine.kv_transfer == "layer" else None
        cached = seq.num_cached_tokens
        written = kv.store_start(cached // T)
        compute_s = 0.0  # this request's own share of the forwards (a packed one is shared by tokens)
        while True:
            if loading:
                step, loading = await kv.first_chunk(sent, loading, on_layer)
                fetched, cached, written = loading, seq.num_cached_tokens, kv.store_start(seq.num_cached_tokens // T)
                sent += loading
                loading = 0
            else:
                t_chunk = time.monotonic()
                step = await self.chunks.chunk(seq, on_layer)
                if req.trace and self.tracer is not None:
                    record_span(self.tracer, "prefill.chunk", t_chunk, time.monotonic(),
                                attrs={"mooncake.computed_tokens": seq.num_computed, "mooncake.compute_s": step.compute_s})
            compute_s += step.compute_s
            self.host.progress += 1
            if req.req_id in self.aborted:
                return
            kv.check()
            full = seq.num_computed // T
            if on_layer is not None:  # the chunk's layers are queued already
                sent = -(-seq.num_computed // T) if step.done else full
            if step.done:
                self.inflight.finish(req.req_id)  # its blocks are cached: those waiting for them go on
                break
            written = await kv.save_to_store(written, full)
            if full > sent:  # block-wise: the chunk's finished blocks travel while the next computes
                await kv.save_blocks(sent, full)
                sent = full
        token = int(step.token)  # type: ignore[arg-type]
        finished = P.FinishReason(step.finished) if step.finished else None
        # The first token goes out now (time to first token); the KV tail follows to decode.
        await self.host.send(P.PrefillDone(
            req.req_id, self.node_id, token, cached_tokens=cached, computed_tokens=len(req.tokens) - cached,
            prefill_s=compute_s, fetched_blocks=fetched, fetch_s=fetch_s, finished=finished, logprob=step.logprob,
            kv_pending_bytes=kv.in_flight() + (len(seq.block_table) - sent) * eng.kv_block_bytes))
        if finished is None:
            if sent < len(seq.block_table):
                await kv.save_blocks(sent, None)
        await kv.save_to_store(written, len(kv.hashes))
        if finished is None:
            with self.host.pool.waiting_on_others(), span(self.tracer if req.trace else None, "prefill.kv_ship"):
                await kv.wait_for_save()
        log.debug("prefill %s: %d tokens, %d cached, %.3fs", req.req_id, len(req.tokens), cached,
                  time.perf_counter() - t_start)

    async def close(self) -> None:
        self.egress.close()
        if self._act_sock is not None:
            self._act_sock.close(0)
        await self.host.close()
