"""A prefill's reused prefix beyond its device cache: the blocks the conductor's fetch plan names
in stores (local node first), imported whole before the prompt computes (``[engine] kv_load =
"block"``) or streamed layer by layer while its first chunk computes (``"layer"``,
``prefix_stream.py``). Blocks read from a store must be the ones asked for, in the model's block
shape and dtype as they travel (``codec.py``), with finite scales; else they are a miss, recomputed
(each refusal counted by reason).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.engine import Engine, Sequence
from mooncake.engine.sequence import PrefillStep
from mooncake.kv.integrity import Rejections, first_nonfinite, leading_match, shape_problem
from mooncake.kv.layers import LayerFn
from mooncake.kv.prefix_stream import PrefixLoadFailed, PrefixStream
from mooncake.kv.store_clients import StoreClients
from mooncake.tiers.client import StoreError

log = logging.getLogger(__name__)
RunEngine = Callable[..., Awaitable[Any]]
Chunk = Callable[[Sequence, LayerFn | None], Awaitable[PrefillStep]]  # the next chunk, batched with others


class PrefixLoader:
    """A prefill's loads of reused prefixes from stores, into its engine (see the module docstring)."""

    def __init__(self, engine: Engine, run_engine: RunEngine, stores: StoreClients, rejections: Rejections,
                 chunk: Chunk) -> None:
        self._engine, self._run_engine, self._stores, self._rejections = engine, run_engine, stores, rejections
        self._chunk = chunk

    async def fetch(self, plans: list[P.FetchPlan], hashes: list[BlockHash]) -> tuple[int, float]:
        """Import the blocks of ``plans`` (contiguous, in order) into the device cache, up to the first
        that misses; (count, seconds)."""
        t0 = time.perf_counter()
        got = 0
        for plan in plans:
            start = plan.start
            try:
                found, blocks = await self._stores.client(plan.endpoint).get(hashes[start:plan.end], prefix=True)
            except StoreError as e:
                log.warning("fetch from %s failed, recomputing instead: %s", plan.endpoint, e)
                self._stores.forget(plan.endpoint, e)
                break
            found, blocks = self._admit(plan.endpoint, hashes[start:plan.end], found, blocks)
            n = await self._run_engine(self._engine.kv.import_blocks, found, torch.stack(blocks)) if found else 0
            got += n
            if n < plan.end - start:
                break
        return got, time.perf_counter() - t0

    async def open_stream(self, plan: P.FetchPlan, hashes: list[BlockHash]) -> tuple[PrefixStream | None, float]:
        """Ask ``plan``'s store to stream its blocks layer by layer; the stream once its first layer is
        in (None: nothing to load), and the seconds that took."""
        t0 = time.perf_counter()
        asked = hashes[plan.start:plan.end]
        try:
            replies = self._stores.client(plan.endpoint).get_layers(asked)
            stream = await PrefixStream.open(plan.endpoint, replies, asked, self._engine.kv.wire_shape,
                                             self._engine.kv.wire_dtype)
        except StoreError as e:
            log.warning("streaming from %s failed, recomputing instead: %s", plan.endpoint, e)
            self._stores.forget(plan.endpoint, e)
            return None, time.perf_counter() - t0
        return stream, time.perf_counter() - t0

    def start_stream(self, req: P.PrefillRequest, seq: Sequence, stream: PrefixStream, have: int,
                     ship_prefix: Callable[[list[torch.Tensor]], None]) -> int:
        """Start landing the streamed prefix into ``seq``'s blocks after its cached ones; how many
        blocks it brings (0: none usable, e.g. the device cache changed meanwhile)."""
        eng, T = self._engine, self._engine.block_tokens
        first = seq.num_cached_tokens // T
        n = min(stream.n, (len(req.tokens) - 1) // T - first) if first == have else 0
        if n <= 0:
            return 0
        seq.num_cached_tokens = seq.num_computed = (first + n) * T
        stream.start(lambda lo, kv: eng.kv.land_layers(seq, first, lo, kv), n, ship_prefix, eng.kv.wire_shape,
                     eng.kv.wire_dtype)
        return n

    async def first_chunk_loading(self, req: P.PrefillRequest, seq: Sequence, stream: PrefixStream,
                                  first: int, n: int, on_layer: LayerFn | None,
                                  past_ready: Callable[[int], None]) -> tuple[PrefillStep, int]:
        """The first chunk over a prefix still streaming in (each layer waits for its past: ``past_ready``);
        the step and the blocks the stream brought. A failed load costs a recompute: the chunk is
        computed again from the blocks before the stream, with nothing of it sent or kept."""
        hook = stream.gate.hold(on_layer) if on_layer is not None else None
        try:
            step = await self._run_engine(self._engine.prefill, seq, hook, past_ready)
        except PrefixLoadFailed as e:
            await stream.close()
            self._rejections.add("checksum" if "checksum" in str(e) else "stream", n)
            if isinstance(stream.error, StoreError):
                self._stores.forget(stream.endpoint, stream.error)
            log.warning("%s: recomputing %d blocks: %s", req.req_id, n, e)
            seq.num_cached_tokens = seq.num_computed = first * self._engine.block_tokens
            return await self._chunk(seq, on_layer), 0
        await self._run_engine(self._engine.kv.adopt_prefix, seq, first, first + n)
        return step, n

    def _admit(self, endpoint: str, asked: list[BlockHash], found: list[BlockHash],
               blocks: list[torch.Tensor]) -> tuple[list[BlockHash], list[torch.Tensor]]:
        """The leading fetched blocks that are the ones asked for, as KV of this model; the rest is a miss."""
        n = leading_match(asked, found)
        if n < len(found):
            self._rejections.add("hash", len(found) - n)
            log.warning("store %s returned blocks that were not asked for: %d of %d used", endpoint, n, len(found))
        problem = shape_problem(blocks[:n], self._engine.kv.wire_shape, self._engine.kv.wire_dtype)
        if problem is not None:
            self._rejections.add("shape", n)
            log.warning("store %s returned unusable KV (%s): recomputing", endpoint, problem)
            n = 0
        bad = first_nonfinite(blocks[:n], self._engine.kv.codec)
        if bad is not None:  # its checksum matched what its writer computed, over a poisoned block
            self._rejections.add("checksum", n - bad)
            log.warning("store %s returned a block with non-finite scales: %d of %d used", endpoint, bad, n)
            n = bad
        return found[:n], blocks[:n]
