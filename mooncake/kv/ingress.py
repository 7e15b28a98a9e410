"""Decode's KV ingress: KV from prefill landing in the blocks decode reserved for it.

Trust: the KV ingress admits only KV from worker keys (under CURVE) that carries the
attempt's token (its route gave it to this decode and to the prefill chosen)
and whose blocks match their checksums and the model's block shape and dtype.
Forged KV (wrong token, unknown sender) is dropped; corrupt KV fails the attempt,
which is recomputed. Each refusal is counted by reason.

KV arrives as whole blocks (``KVTransfer``: a reused prefix, or a block-wise prefill) or one
layer at a time (``KVLayer``: layer-wise prefill); each layer lands straight in the reserved
blocks, and a block counts as received once all its layers are in. Messages of different
requests land concurrently, one request's in the order they came (``Slot.kv_lock``): each
write waits for the engine thread between decode steps, and handled one at a time a burst
of requests would wait a step per message before its second token (BENCHMARKS.md section 11).
For the same reason the messages of one request that arrive while its earlier ones land go
together, in one engine call (a layer-wise prefix is one message per layer), and the call
that completes a request's KV also begins its decoding when the first token is known, so
that the sequence joins the next decode step instead of waiting for one more engine call.

A decode instance holds one ``KVIngress`` (``worker.kv``) and is, to it, its ``DecodeSlots``: the
declared interface of the decode side of KV movement (as ``KVConnector`` is the prefill side's):
the reserved and running requests (``incoming``, ``running``: each a ``Slot``), the engine thread,
the store clients, and what becomes of a slot (given up, started, joined to the batch).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import zmq.asyncio

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.engine import Engine, Sequence
from mooncake.kv.codec import KVCodec
from mooncake.kv.integrity import Rejections, first_corrupt, first_nonfinite, shape_problem
from mooncake.kv.link import bind_kv_ingress
from mooncake.kv.store_clients import StoreClients
from mooncake.security import Curve, allowed
from mooncake.sockets import recv_multipart

log = logging.getLogger(__name__)
STORE_RUN_BLOCKS = 32  # a pipeline group's prompt blocks go to the store in runs of this many
KV_IN_FLIGHT = 64  # KV messages landing at once (received, not yet written); more wait in the socket


@dataclass(eq=False)
class Slot:
    """A request decode holds: reserved (KV arriving), then running."""

    msg: P.DecodeRequest
    seq: Sequence
    layers_in: list[int]  # per layer: KV blocks received so far (in order); whole blocks count for all
    first_token: int | None = None
    started: bool = False  # decoding has begun (or is beginning)
    next_index: int = 0  # index of the next token among the request's generated tokens
    stored: int = -1  # a pipeline group's prompt: blocks before this are written to the store (-1: not ours)
    reserved_at: float = 0.0  # time.monotonic() when its blocks were reserved
    started_at: float = 0.0  # ... and when its decoding began (its KV in, its first token known)
    preempted: bool = False  # given back for a later attempt (its KV pool was full)
    kv_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # its KV messages land one batch at a time, in order
    # its KV messages received and waiting to land (with the next batch of its messages)
    inbox: list[tuple[P.KVTransfer | P.KVLayer, list[torch.Tensor]]] = field(default_factory=list)

    @property
    def next_block(self) -> int:
        """Blocks whose every layer is in (a block is used only once it is whole)."""
        return min(self.layers_in)

    @property
    def kv_complete(self) -> bool:
        return self.next_block >= len(self.seq.block_table)


class DecodeSlots(Protocol):
    """The decode side of KV movement, as the ingress sees the instance that holds it."""

    engine: Engine
    incoming: dict[str, Slot]  # reserved, KV arriving
    running: dict[str, Slot]  # decoding
    stores: StoreClients  # a pipeline group's prompt blocks go to a store through them

    async def run_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread (between decode steps)."""

    async def give_up(self, slot: Slot, why: str) -> None:
        """Free a reserved or running request and report it to its frontend."""

    async def maybe_start(self, slot: Slot) -> None:
        """Begin decoding ``slot`` if its KV is in and its first token known."""

    def join(self, slot: Slot) -> None:
        """A sequence whose decoding began joins the batch at the next step."""


class KVIngress:
    """Decode's handling of KV messages (see the module docstring)."""

    def __init__(self, slots: DecodeSlots, curve: Curve | None, rejections: Rejections) -> None:
        self.slots, self.engine, self.curve, self.rejections = slots, slots.engine, curve, rejections
        self.sock: zmq.asyncio.Socket | None = None  # bound by ``bind``
        self.landing = 0  # KV writes on the engine thread now (engine work: a hang there is a stall)
        self.writes = 0  # KV writes done (engine progress: layer-wise, one write per layer and chunk)
        self._tasks: set[asyncio.Task] = set()  # KV messages landing

    def bind(self, ctx: zmq.asyncio.Context, host: str, port: int, max_message_bytes: int) -> str:
        """Bind the KV socket (``link.bind_kv_ingress``); its endpoint."""
        self.sock, endpoint = bind_kv_ingress(ctx, self.curve, host, port, max_message_bytes)
        return endpoint

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.sock is not None:
            self.sock.close(0)

    async def receive_loop(self) -> None:
        """Receive KV messages until cancelled, up to ``KV_IN_FLIGHT`` landing at once."""
        assert self.sock is not None
        room = asyncio.Semaphore(KV_IN_FLIGHT)

        def landed(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            room.release()

        while True:
            await room.acquire()
            frames = await recv_multipart(self.sock)
            task = asyncio.create_task(self._land(frames))
            self._tasks.add(task)
            task.add_done_callback(landed)

    async def _land(self, frames: list) -> None:
        try:
            await self.on_kv(frames)
        except Exception:  # one bad message never stops the ingress
            log.exception("error handling a KV message")

    async def on_kv(self, frames: list) -> None:
        """One received KV message: checked, then landed with the others of its request."""
        if not allowed(self.curve, frames[0], ("worker",)):
            self.rejections.add("unauthorized")
            log.warning("dropping KV from a non-worker key")
            return
        try:
            msg, tensors = P.decode(frames, self.engine.kv.wire_shape, self.engine.kv.wire_dtype)
            if not isinstance(msg, (P.KVTransfer, P.KVLayer)):
                raise P.ProtocolError(f"expected KV, got {type(msg).__name__}")
            if isinstance(msg, P.KVLayer) and (len(tensors) != 1 or len(tensors[0]) < 1):
                raise P.ProtocolError("a KV layer transfer carries one tensor of at least one block")
        except P.ProtocolError as e:
            log.warning("dropping malformed KV message: %s", e)
            return
        slot = self.slots.incoming.get(msg.req_id)
        if slot is None:
            log.debug("KV of %s, which is not reserved here: dropped", msg.req_id)
            return
        if not hmac.compare_digest(msg.token, slot.msg.kv_token):
            self.rejections.add("token", len(tensors))
            log.warning("KV of %s without the attempt's token (not from its prefill): dropped", msg.req_id)
            return
        slot.inbox.append((msg, tensors))
        async with slot.kv_lock:  # taken in arrival order: nothing above awaits
            batch, slot.inbox = slot.inbox, []
            if not batch:  # landed with an earlier message of its request
                return
            if self.slots.incoming.get(msg.req_id) is not slot:  # given up, aborted or failed meanwhile
                log.debug("KV of %s, no longer reserved here: dropped", msg.req_id)
                return
            await self.land_kv(slot, batch)

    async def land_kv(self, slot: Slot, batch: list[tuple[P.KVTransfer | P.KVLayer, list[torch.Tensor]]]) -> None:
        """Check KV messages of ``slot`` (in arrival order) and write them in one engine call, which
        also begins decoding when they complete the KV and the first token is known."""
        eng = self.engine
        wire = eng.kv.wire_shape
        for msg, tensors in batch:
            layer = msg.layer if isinstance(msg, P.KVLayer) else None
            problem = shape_problem([t[0] for t in tensors] if layer is not None else tensors,
                                    wire if layer is None else wire[1:], eng.kv.wire_dtype)
            if problem:
                self.rejections.add("shape", len(tensors))
                await self.slots.give_up(slot, f"its KV is corrupt ({problem}): recomputed elsewhere")
                return
        bad = await asyncio.to_thread(_first_corrupt_of, batch, eng.kv.codec)
        if bad is not None:
            self.rejections.add("checksum", len(batch[bad[0]][1]))
            await self.slots.give_up(slot, f"its KV is corrupt (transfer {bad[1]} fails its checksum or decodes "
                                      "non-finite): recomputed elsewhere")
            return
        layers_in = list(slot.layers_in)
        writes: list[tuple[int, int | None, list[torch.Tensor]]] = []
        for msg, tensors in batch:
            layer = msg.layer if isinstance(msg, P.KVLayer) else None
            n = len(tensors[0]) if layer is not None else len(tensors)
            if layer is None:  # whole blocks continue where every layer is
                expected = min(layers_in) if max(layers_in) == min(layers_in) else -1
            else:
                expected = layers_in[layer] if 0 <= layer < len(layers_in) else -1
            if msg.first_block != expected or msg.first_block + n > len(slot.seq.block_table):
                log.warning("KV of %s (layer %s): blocks %d..%d do not continue the %d received of %d: request failed",
                            msg.req_id, layer, msg.first_block, msg.first_block + n, expected,
                            len(slot.seq.block_table))
                await self.slots.give_up(slot, "KV arrived out of order or oversized")
                return
            if layer is not None:
                layers_in[layer] += n
            else:
                layers_in = [b + n for b in layers_in]
            if n:
                writes.append((msg.first_block, layer, tensors))
        begin = (min(layers_in) >= len(slot.seq.block_table) and slot.first_token is not None
                 and not slot.started)
        slot.started |= begin
        if begin:
            slot.started_at = time.monotonic()
        self.landing += 1
        row = len(self.slots.running) if len(self.slots.running) < eng.max_batch else None  # its row at its first step
        try:
            await self.slots.run_engine(_write_landed, eng, slot.seq, writes, row, slot.first_token if begin else None)
        except Exception as e:  # this request's KV is unusable; the ingress goes on
            log.exception("writing KV of %s failed", slot.msg.req_id)
            await self.slots.give_up(slot, f"writing its KV failed: {type(e).__name__}: {e}")
            return
        finally:
            self.landing -= 1
        self.writes += len(writes)
        slot.layers_in = layers_in
        await self._store_whole_blocks(slot)
        if begin:
            self.slots.join(slot)
        else:
            await self.slots.maybe_start(slot)

    async def _store_whole_blocks(self, slot: Slot) -> None:
        """A pipeline group's prompt (no stage holds whole blocks): write its full blocks to the store
        as they become whole here, a prefill chunk's worth at a time, the rest once all KV is in."""
        full = min(slot.next_block, len(slot.msg.tokens) // self.engine.block_tokens)
        if slot.stored < 0 or not slot.msg.store_endpoint or full - slot.stored < (
                1 if slot.kv_complete else STORE_RUN_BLOCKS):
            return
        hashes = [BlockHash(h) for h in slot.msg.hashes[slot.stored:full]]
        await self.slots.stores.save_blocks(slot.msg.store_endpoint, slot.seq, hashes, slot.stored, full)
        slot.stored = full


def _first_corrupt_of(batch: list[tuple[P.KVTransfer | P.KVLayer, list[torch.Tensor]]],
                      codec: KVCodec) -> tuple[int, int] | None:
    """(message, transfer) of the first frame that fails its checksum or holds a non-finite scale, or
    None (a worker thread)."""
    for i, (msg, tensors) in enumerate(batch):
        bad = first_corrupt(tensors, msg.checksums)
        if bad is None:
            bad = first_nonfinite(tensors, codec)
        if bad is not None:
            return i, bad
    return None


def _write_landed(engine: Engine, seq: Sequence, writes: list[tuple[int, int | None, list[torch.Tensor]]],
                  row: int | None, first_token: int | None) -> None:
    """The engine thread: write checked KV messages ``(first block, layer or None, frames)`` in order,
    then, with ``first_token``, begin decoding (all the sequence's KV is in)."""
    for first, layer, tensors in writes:
        if layer is None:
            engine.kv.write_kv(seq, first, torch.stack(tensors), row)
        else:
            engine.kv.write_kv_layer(seq, first, layer, tensors[0], row)
    if first_token is not None:
        engine.begin_decoding(seq, first_token)
