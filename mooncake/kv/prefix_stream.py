"""Layer-wise loading of a cached prefix from a store, just ahead of the compute that needs it.

``[engine] kv_load = "layer"``: instead of fetching whole blocks and then computing, the prefill
asks the store for the prefix as a stream (``GetLayers``: one ``LayerSlices`` reply per layer,
``[n, 1, *wire_shape[1:]]`` as the blocks travel (``codec.py``), lowest layer first) and starts the
forward of the new tokens as soon as the first reply says how many blocks the store holds. Each
reply is decoded into the sequence's own (not yet keyed) pool blocks in a worker thread while the
engine thread computes; the forward waits, per layer, only for that layer (``LayerGate.wait``, the
forward's ``past_ready``). A stream closed meanwhile returns only once no landing writes the pool.

Integrity: every block carries the checksum it was put with (xxh3_64 of the whole block, from the
process that computed it; 0 where the store does not know it, which is not checked, as for whole
blocks: ``integrity.verified_prefix``). A block's layer slices are consecutive byte ranges of its layout
``[layers, ...]``, so one streaming xxh3 per block over its slices, in order, gives the
block's checksum when the last layer is in. Until then nothing derived from the prefix leaves the
process: the new tokens' per-layer KV for decode is held back (``LayerGate.hold``), the last
layer's gate opens only once every block verified, and the prefix itself goes to decode (one
``KVLayer`` per layer, the received frames as they are) only then. A store that stops answering,
a malformed reply or a checksum mismatch fails the gate: the forward raises ``PrefixLoadFailed``
having written nothing, and the prefill recomputes those blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable

import torch
import xxhash

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.kv.integrity import leading_match
from mooncake.kv.layers import LayerFn
from mooncake.kv.timing import GATE_TIMEOUT_S

log = logging.getLogger(__name__)


class PrefixLoadFailed(RuntimeError):
    """The prefix could not be loaded (store gone, bad reply, checksum mismatch): recompute it."""


class LayerGate:
    """Which layers of a loading prefix are in the pool (thread-safe: opened on the event loop,
    waited on by the engine thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready = 0  # layers [0, ready) are in
        self._error: BaseException | None = None
        self.complete = False  # every layer in and every block verified

    def open(self, upto: int, complete: bool = False) -> None:
        with self._cond:
            self._ready = max(self._ready, upto)
            self.complete = self.complete or complete
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if not self.complete and self._error is None:
                self._error = error
            self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Until ``layer`` is in; raises ``PrefixLoadFailed`` if the load failed first."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready > layer or self._error is not None, GATE_TIMEOUT_S):
                self._error = TimeoutError(f"layer {layer} of the prefix did not arrive in {GATE_TIMEOUT_S:.0f}s")
            if self._error is not None:
                raise PrefixLoadFailed(f"loading the prefix failed: {self._error}") from self._error

    def hold(self, fn: LayerFn) -> LayerFn:
        """``fn`` for the forward's per-layer KV hook, its calls held back until the prefix is
        verified (then replayed in order); dropped if the load fails."""
        held: list[tuple[int, int, torch.Tensor]] = []

        def hook(layer: int, first: int, kv: torch.Tensor) -> None:
            if not self.complete:
                held.append((layer, first, kv))
                return
            while held:
                fn(*held.pop(0))
            fn(layer, first, kv)
        return hook


Replies = AsyncIterator[tuple[P.LayerSlices, torch.Tensor | None]]


class PrefixStream:
    """One prefix streamed from one store into one sequence. ``open`` waits for the first reply
    (how many of the asked blocks the store holds); ``start`` lands them into ``seq``'s blocks
    ``[first_block, first_block + n)`` in the background."""

    def __init__(self, endpoint: str, replies: Replies, first: P.LayerSlices, kv: torch.Tensor, n: int) -> None:
        self.endpoint, self._replies, self._first, self._first_kv, self.n = endpoint, replies, first, kv, n
        self.gate = LayerGate()
        self._task: asyncio.Task | None = None

    @classmethod
    async def open(cls, endpoint: str, replies: Replies, asked: list[BlockHash], block_shape: tuple[int, ...],
                   dtype: torch.dtype) -> PrefixStream | None:
        """The stream, once its first reply is in; None when the store holds none of ``asked`` (or
        returns something else than their leading blocks in this model's layout: a miss)."""
        try:
            first, kv = await anext(replies)
        except StopAsyncIteration:
            return None
        n = leading_match(asked, first.hashes)
        if kv is None or n == 0 or _slice_problem(first, kv, len(first.hashes), block_shape, dtype, 0):
            await replies.aclose()
            return None
        return cls(endpoint, replies, first, kv, n)

    def start(self, land: Callable[[int, torch.Tensor], None], n_use: int,
              on_verified: Callable[[list[torch.Tensor]], None], block_shape: tuple[int, ...],
              dtype: torch.dtype) -> None:
        """Land the first ``n_use`` blocks: ``land(lo, kv)`` per reply (``kv``: ``[n_use, layers, ...]``),
        then, once all are verified, ``on_verified(layers)`` (one ``[n_use, *wire_shape[1:]]`` per layer)
        before the gate's last layer opens."""
        self._task = asyncio.create_task(self._land(land, n_use, on_verified, block_shape, dtype))

    async def _land(self, land: Callable[[int, torch.Tensor], None], n_use: int,
                    on_verified: Callable[[list[torch.Tensor]], None], block_shape: tuple[int, ...],
                    dtype: torch.dtype) -> None:
        sums = self._first.checksums[:n_use]
        hashers = [xxhash.xxh3_64() for _ in range(n_use)]
        layers: list[torch.Tensor] = []
        reply, kv = self._first, self._first_kv
        hashes, expect_lo = self._first.hashes, 0
        try:
            while True:
                problem = (None if reply.hashes == hashes else "the blocks changed midway") or \
                    _slice_problem(reply, kv, len(hashes), block_shape, dtype, expect_lo)
                if problem:
                    raise PrefixLoadFailed(f"store {self.endpoint} streamed unusable KV: {problem}")
                assert kv is not None
                part = kv[:n_use]
                rows = part.contiguous().view(n_use, -1).view(torch.uint8).numpy()  # one byte row per block
                for h, row in zip(hashers, rows):  # (not a torch view per block: 30 x n of them held the GIL)
                    h.update(row)
                await _landed(asyncio.get_running_loop().run_in_executor(None, land, reply.lo, part))
                layers.extend(part.unbind(1))
                expect_lo = reply.hi
                if reply.last or reply.hi >= block_shape[0]:
                    break
                self.gate.open(reply.hi)
                reply, kv = await anext(self._replies)
            if expect_lo != block_shape[0]:
                raise PrefixLoadFailed(f"store {self.endpoint} ended the stream at layer {expect_lo}")
            bad = next((i for i, (h, s) in enumerate(zip(hashers, sums)) if s and h.intdigest() != s), None)
            if bad is not None:
                raise PrefixLoadFailed(f"block {bad} from store {self.endpoint} fails its checksum")
            on_verified(layers)
            self.gate.open(block_shape[0], complete=True)
        except StopAsyncIteration:
            self.gate.fail(PrefixLoadFailed(f"store {self.endpoint} ended the stream early"))
        except BaseException as e:  # the forward learns it from the gate; the caller logs it
            self.gate.fail(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            await self._replies.aclose()

    @property
    def error(self) -> BaseException | None:
        return self.gate._error

    async def close(self) -> None:
        """Stop landing (an aborted or finished request); the gate fails if it was still open."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        elif self._task is None:
            await self._replies.aclose()


async def _landed(landing: asyncio.Future) -> None:
    """Wait for a landing in a worker thread; cancelled, still wait for it before the cancellation
    goes on: a closed stream's blocks are freed and reused, and a late landing would overwrite them."""
    try:
        await asyncio.shield(landing)
    except asyncio.CancelledError:
        while not landing.done():
            try:
                await asyncio.wait({landing})
            except asyncio.CancelledError:
                pass
        raise


def _slice_problem(reply: P.LayerSlices, kv: torch.Tensor | None, n: int, block_shape: tuple[int, ...],
                   dtype: torch.dtype, expect_lo: int) -> str | None:
    """Why a reply is not layers ``[expect_lo, hi)`` of ``n`` blocks of this model, or None."""
    if kv is None or reply.lo != expect_lo or not reply.lo < reply.hi <= block_shape[0]:
        return f"layers {reply.lo}..{reply.hi} where layer {expect_lo} was next"
    want = (n, reply.hi - reply.lo, *block_shape[1:])
    if tuple(kv.shape) != want or kv.dtype != dtype:
        return f"{kv.dtype}{list(kv.shape)} is not {dtype}{list(want)}"
    return None
