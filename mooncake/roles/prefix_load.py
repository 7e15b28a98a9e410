"""A prefill's reused prefix beyond its device cache: the blocks the conductor's fetch plan names
in stores (local node first), imported whole before the prompt computes (``[engine] kv_load =
"block"``) or streamed layer by layer while its first chunk computes (``"layer"``,
``prefix_stream.py``). Blocks read from a store must be the ones asked for, in the model's block
shape and dtype; else they are a miss, recomputed (each refusal counted by reason).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.engine import Sequence
from mooncake.engine.layerwise import LayerFn
from mooncake.engine.sequence import PrefillStep
from mooncake.kv_integrity import leading_match, shape_problem
from mooncake.roles.prefix_stream import PrefixLoadFailed, PrefixStream
from mooncake.tiers.client import StoreError

if TYPE_CHECKING:
    from mooncake.roles.prefill import PrefillWorker

log = logging.getLogger(__name__)


async def fetch_prefix(w: PrefillWorker, req: P.PrefillRequest, hashes: list[BlockHash],
                       have: int) -> tuple[int, float]:
    """Import the planned store blocks that follow the ``have`` cached ones; (count, seconds)."""
    t0 = time.perf_counter()
    got = 0
    for plan in req.fetch:
        start = max(plan.start, have + got)
        if start >= plan.end:
            continue
        if start != have + got:
            break  # a gap: the rest would not be a prefix
        try:
            found, blocks = await w.store(plan.endpoint).get(hashes[start:plan.end], prefix=True)
        except StoreError as e:
            log.warning("fetch from %s failed, recomputing instead: %s", plan.endpoint, e)
            w.forget_store(plan.endpoint, e)
            break
        found, blocks = admit_fetched(w, plan.endpoint, hashes[start:plan.end], found, blocks)
        if found:
            n = await w.run_engine(w.engine.import_blocks, found, torch.stack(blocks))
            got += n
            if n < plan.end - start:
                break
        else:
            break
    return got, time.perf_counter() - t0


async def open_stream(w: PrefillWorker, req: P.PrefillRequest, hashes: list[BlockHash],
                      have: int) -> tuple[PrefixStream | None, float]:
    """Ask the store planned for the blocks after the ``have`` cached ones to stream them layer
    by layer; the stream once its first layer is in (None: nothing to load), and the seconds that took."""
    t0 = time.perf_counter()
    plan = next((p for p in req.fetch if p.start <= have < p.end), None)
    if plan is None:
        return None, 0.0
    asked = hashes[have:plan.end]
    try:
        replies = w.store(plan.endpoint).get_layers(asked)
        stream = await PrefixStream.open(plan.endpoint, replies, asked, w.engine.block_shape, w.engine.dtype)
    except StoreError as e:
        log.warning("streaming from %s failed, recomputing instead: %s", plan.endpoint, e)
        w.forget_store(plan.endpoint, e)
        return None, time.perf_counter() - t0
    return stream, time.perf_counter() - t0


def start_stream(w: PrefillWorker, req: P.PrefillRequest, seq: Sequence, stream: PrefixStream, have: int,
                 ship_prefix: Callable[[list[torch.Tensor]], None]) -> int:
    """Start landing the streamed prefix into ``seq``'s blocks after its cached ones; how many
    blocks it brings (0: none usable, e.g. the device cache changed meanwhile)."""
    eng, T = w.engine, w.engine.block_tokens
    first = seq.num_cached_tokens // T
    n = min(stream.n, (len(req.tokens) - 1) // T - first) if first == have else 0
    if n <= 0:
        return 0
    seq.num_cached_tokens = seq.num_computed = (first + n) * T
    stream.start(lambda lo, kv: eng.land_layers(seq, first, lo, kv), n, ship_prefix, eng.block_shape, eng.dtype)
    return n


async def first_chunk_loading(w: PrefillWorker, req: P.PrefillRequest, seq: Sequence, stream: PrefixStream,
                              first: int, n: int, on_layer: LayerFn | None) -> tuple[PrefillStep, int]:
    """The first chunk over a prefix still streaming in (each layer waits for its past); the step
    and the blocks the stream brought. A failed load costs a recompute: the chunk is computed
    again from the blocks before the stream, with nothing of it sent or kept."""
    hook = stream.gate.hold(on_layer) if on_layer is not None else None
    try:
        step = await w.run_engine(w.engine.prefill, seq, hook, stream.gate.wait)
    except PrefixLoadFailed as e:
        await stream.close()
        w.rejections.add("checksum" if "checksum" in str(e) else "stream", n)
        if isinstance(stream.error, StoreError):
            w.forget_store(stream.endpoint, stream.error)
        log.warning("%s: recomputing %d blocks: %s", req.req_id, n, e)
        seq.num_cached_tokens = seq.num_computed = first * w.engine.block_tokens
        return await w.chunks.chunk(seq, on_layer), 0
    await w.run_engine(w.engine.adopt_prefix, seq, first, first + n)
    return step, n


def admit_fetched(w: PrefillWorker, endpoint: str, asked: list[BlockHash], found: list[BlockHash],
                  blocks: list[torch.Tensor]) -> tuple[list[BlockHash], list[torch.Tensor]]:
    """The leading fetched blocks that are the ones asked for, as KV of this model; the rest is a miss."""
    n = leading_match(asked, found)
    if n < len(found):
        w.rejections.add("hash", len(found) - n)
        log.warning("store %s returned blocks that were not asked for: %d of %d used", endpoint, n, len(found))
    problem = shape_problem(blocks[:n], w.engine.block_shape, w.engine.dtype)
    if problem is not None:
        w.rejections.add("shape", n)
        log.warning("store %s returned unusable KV (%s): recomputing", endpoint, problem)
        n = 0
    return found[:n], blocks[:n]
