"""A prefill request's KV connector: its reused prefix loaded from stores, its KV to decode and
to the node's store.

Loading: the blocks the conductor's fetch plan names after those in the device cache, imported
whole before the prompt computes (``[engine] kv_load = "block"``) or streamed layer by layer while
its first chunk computes (``"layer"``, not for a pipeline stage; ``prefix_load.py``,
``prefix_stream.py``). Saving to decode: the reused prefix first (whole blocks; a streamed one layer
by layer once verified), then each chunk's KV, layer by layer as the engine computes it
(``kv_transfer = "layer"``: ``save_layer`` on the engine thread) or block by block after each chunk
(``save_blocks``), all through one ``KVSender`` so that it leaves in order, off the compute path.
Saving to the store: the blocks each chunk completes, in the background (``StoreClients``).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Iterable

import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.engine import Engine, Sequence
from mooncake.engine.sequence import PrefillStep
from mooncake.kv.connector import KVConnector
from mooncake.kv.layers import LayerFn
from mooncake.kv.prefix_load import PrefixLoader
from mooncake.kv.prefix_stream import PrefixStream
from mooncake.kv.sender import KVSender
from mooncake.kv.store_clients import StoreClients

ShipTo = Callable[[str, P.Msg, list[torch.Tensor]], Awaitable[None]]  # (endpoint, msg, frames): ``KVEgress.ship``


async def export_in_thread(engine: Engine, seq: Sequence, first: int, last: int | None) -> torch.Tensor:
    """A copy of ``seq``'s computed blocks ``[first, last)`` for decode, read in a worker thread rather
    than on the engine thread: the blocks are this request's, held and computed, so reading them
    needs nothing of the engine, whose thread may meanwhile compute other prompts' chunks for a
    second or more, and the KV (the tail: the decode's second token) would wait behind them
    (BENCHMARKS.md section 11)."""
    return await asyncio.to_thread(engine.kv.export_sequence, seq, first, last)


class PrefillKV(KVConnector):
    """One prefill request's KV (see the module docstring). ``frame_blocks``: blocks of one layer per
    ``KVLayer`` message; ``layer_load``: stream the prefix layer by layer."""

    def __init__(self, req: P.PrefillRequest, hashes: list[BlockHash], engine: Engine, loader: PrefixLoader,
                 ship: ShipTo, stores: StoreClients, frame_blocks: int, layer_load: bool) -> None:
        self.req, self.hashes, self._engine, self._loader = req, hashes, engine, loader
        self._ship, self._stores, self._frame_blocks = ship, stores, frame_blocks
        self._layer_load = layer_load and req.stage is None
        self.stream: PrefixStream | None = None
        self._sender: KVSender | None = None
        self._seq: Sequence | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- planning half

    def load_plan(self, have: int) -> list[P.FetchPlan]:
        plans: list[P.FetchPlan] = []
        nxt = have
        for plan in self.req.fetch:
            start = max(plan.start, nxt)
            if start >= plan.end:
                continue
            if start != nxt:
                break  # a gap: the rest would not be a prefix
            plans.append(P.FetchPlan(start, plan.end, plan.endpoint))
            nxt = plan.end
        return plans[:1] if self._layer_load else plans  # a stream comes from one store

    def store_start(self, cached: int) -> int:
        """The first block to write to the store when ``cached`` leading blocks are cached or fetched:
        the first it computes, or earlier where the conductor's ``store_range`` starts (the first
        block the store lacks: a recurring prefix in the device cache is written from there)."""
        return min(self.req.store_range[0], cached) if self.req.store_range else cached

    def save_plan(self, saved: int, full: int) -> tuple[int, int]:
        full = min(full, len(self.hashes), *self.req.store_range[1:])
        if not self.req.store_endpoint or full <= saved:
            return saved, saved
        return saved, full

    # ---- worker half

    async def start_load(self, have: int) -> tuple[int, float]:
        if not self.req.fetch:
            return 0, 0.0
        plans = self.load_plan(have)
        if not self._layer_load:
            return await self._loader.fetch(plans, self.hashes)
        if not plans:
            return 0, 0.0
        self.stream, seconds = await self._loader.open_stream(plans[0], self.hashes)
        return 0, seconds

    async def attach(self, seq: Sequence, have: int) -> int:
        """As ``KVConnector.attach``; also ships the blocks ``seq`` holds from the device cache whole
        (not for a pipeline stage, which ships its own layers of them: ``save_prefix_layers``), before
        a streamed prefix starts landing after them."""
        req = self.req
        self._seq, self._loop = seq, asyncio.get_running_loop()
        self._sender = KVSender(lambda msg, tensors: self._ship(req.decode_endpoint, msg, tensors))
        if req.stage is not None:
            return 0
        cached = seq.num_cached_tokens // self._engine.block_tokens
        if cached:
            await self.save_blocks(0, cached)
        if self.stream is None:
            return 0

        def ship_prefix(layers: list[torch.Tensor]) -> None:  # event loop: the streamed prefix, verified
            self.save_prefix_layers(cached, enumerate(layers))

        return self._loader.start_stream(req, seq, self.stream, have, ship_prefix)

    def keep_local(self, seq: Sequence) -> None:
        """A colocated instance's request: its KV stays where it is computed (only the store writes go out)."""
        self._seq = seq

    async def first_chunk(self, first: int, n: int, on_layer: LayerFn | None) -> tuple[PrefillStep, int]:
        """The first chunk over the ``n`` blocks still streaming in from block ``first``; the step and
        the blocks the stream brought (0: it failed, and the chunk was computed without them)."""
        assert self.stream is not None and self._seq is not None
        return await self._loader.first_chunk_loading(self.req, self._seq, self.stream, first, n, on_layer,
                                                      self.wait_for_layer)

    def wait_for_layer(self, layer: int) -> None:
        assert self.stream is not None
        self.stream.gate.wait(layer)

    def save_layer(self, layer: int, first: int, kv: torch.Tensor) -> None:
        """The engine thread: one layer of the blocks a chunk completes, encoded here, queued to decode."""
        assert self._sender is not None
        self._sender.put_layer(self.req, layer, first, self._engine.kv.codec.encode(kv), self._frame_blocks, self._loop)

    def save_prefix_layers(self, first: int, layers: Iterable[tuple[int, torch.Tensor]]) -> None:
        """``(layer, kv)`` pairs of the blocks from ``first``, queued now (the event loop)."""
        assert self._sender is not None
        for layer, kv in layers:
            self._sender.put_layer(self.req, layer, first, kv.contiguous(), self._frame_blocks)

    async def save_blocks(self, first: int, last: int | None) -> None:
        assert self._sender is not None and self._seq is not None
        self._sender.put_blocks(self.req, first, await export_in_thread(self._engine, self._seq, first, last))

    async def save_to_store(self, saved: int, full: int) -> int:
        first, end = self.save_plan(saved, full)
        if end <= first:
            return saved
        assert self._seq is not None
        await self._stores.save_blocks(self.req.store_endpoint, self._seq, self.hashes[first:end], first, end)
        return end

    def check(self) -> None:
        assert self._sender is not None
        self._sender.check()

    async def wait_for_save(self) -> None:
        assert self._sender is not None
        await self._sender.finish()

    def in_flight(self) -> int:
        return self._sender.pending_bytes if self._sender is not None else 0

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
        if self._sender is not None:
            self._sender.cancel()
