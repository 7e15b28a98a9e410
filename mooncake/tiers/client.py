"""StoreClient: async client of a StoreServer (two DEALERs, for puts and the rest; replies matched
by request id).

Many calls may be in flight at once from one event loop; each waits at most
``timeout_s``, plus a second per MB it sends and the calls queued before it on its socket send (a
large put on a slow or shared link is not a dead store), and then raises ``StoreUnavailable``
(never hangs). Puts travel on a socket of their own: reads and control calls never queue behind
background write-backs (on a 50 Mbit/s link a prefill's write-backs of one long prompt took longer
than a read's timeout). An ``Error``
reply raises ``StoreError``. The socket is created on first use and belongs to
that event loop: use one client per loop.

Same-node fast path: with ``shm=None`` (default) a client whose endpoint is
``ipc://`` or loopback moves block bytes through shared-memory segments
(``mooncake.tiers.shm``) for requests of at least ``shm_min_bytes``; the
socket path is used otherwise, and for good if the server cannot attach. Segments are reused; a
client holds at most ``shm_max_segments`` (16 MiB or more each), and a request that finds them
all busy goes over the socket rather than fault in a fresh one.

Tensors returned by ``get`` over the socket are read-only views of the received
frames (no copy); over shared memory they are fresh copies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, AsyncIterator, Callable, Sequence

import torch
import zmq
import zmq.asyncio

from mooncake.security import Curve
from mooncake.kv.integrity import verified_prefix
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES, limit_message_size, recv_multipart
from mooncake.tracing.context import current_traceparent

from ..blocks import BlockHash
from ..protocol import (Blocks, Error, Exists, Get, GetLayers, Keep, LayerSlices, Msg, Ok, ProtocolError, Put, Remove,
                        Replicate, ShmBlocks, ShmGet, ShmPut, StatsQuery, decode, encode)
from .shm import SEGMENT_BYTES, SegmentPool, aligned, is_local_endpoint, shm_available

SLOW_LINK_BYTES_PER_S = 1e6  # what a call's payload adds to its timeout: a second per MB

MiB = 1 << 20
log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """The store answered with an error (``code`` says which kind)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class StoreUnavailable(StoreError):
    """No answer within the timeout (store down or overloaded), or the client is closed."""


def _blocks_list(blocks: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(blocks, torch.Tensor):
        return list(blocks.unbind(0))
    return list(blocks)


class StoreClient:
    def __init__(self, endpoint: str, timeout_s: float = 10.0, shm: bool | None = None,
                 shm_min_bytes: int = 256 * 1024, shm_max_bytes: int = 1 << 30, shm_max_segments: int = 8,
                 curve: Curve | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MSG_BYTES,
                 on_corrupt: Callable[[int], Any] | None = None) -> None:
        """``on_corrupt(n)``: ``get`` returned n blocks that fail their checksums (they are left out)."""
        self.max_message_bytes = max_message_bytes
        self.on_corrupt = on_corrupt
        self.endpoint = endpoint
        self.curve = curve
        self.term = 0  # the leadership term its store orders (Keep, Replicate, Remove) carry: a conductor's
        self.timeout_s = timeout_s
        self.shm = (is_local_endpoint(endpoint) and shm_available()) if shm is None else shm
        self.shm_min_bytes = shm_min_bytes
        self._ctx: zmq.asyncio.Context | None = None
        self._socks: dict[str, zmq.asyncio.Socket] = {}  # lane ("main", "puts") -> its DEALER
        self._readers: list[asyncio.Task] = []
        self._queued_bytes: dict[str, int] = {}  # lane -> payload bytes of its calls in flight
        self._pending: dict[bytes, asyncio.Future] = {}
        self._streams: dict[bytes, asyncio.Queue] = {}  # request id -> replies of a GetLayers stream
        self._ids = itertools.count(1)
        self._segs = SegmentPool(shm_max_bytes, shm_max_segments)
        self._get_hint = SEGMENT_BYTES  # a get's segment: grown when its blocks did not all fit
        self._closed = False

    # ---------------------------------------------------------------- transport

    def _ensure(self, lane: str = "main") -> zmq.asyncio.Socket:
        if self._closed:
            raise StoreUnavailable("client is closed")
        if lane not in self._socks:
            ctx = self._ctx = self._ctx or zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            limit_message_size(sock, self.max_message_bytes)
            if self.curve is not None:
                self.curve.client(sock, "store")
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise StoreUnavailable(f"cannot connect to {self.endpoint}: {e}") from None
            self._socks[lane] = sock
            self._readers.append(asyncio.create_task(self._read(sock)))
        return self._socks[lane]

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await recv_multipart(sock)
            stream = self._streams.get(frames[0].bytes)
            if stream is not None:
                try:
                    stream.put_nowait(decode(frames[1:]))
                except ProtocolError as e:
                    stream.put_nowait(StoreError(f"malformed reply: {e}", "bad_reply"))
                continue
            fut = self._pending.pop(frames[0].bytes, None)
            if fut is None or fut.done():
                continue  # a reply that came after its timeout
            try:
                fut.set_result(decode(frames[1:]))
            except ProtocolError as e:
                fut.set_exception(StoreError(f"malformed reply: {e}", "bad_reply"))

    async def _call(self, msg: Msg, tensors: Sequence[torch.Tensor] = (), lane: str = "main"
                    ) -> tuple[Msg, list[torch.Tensor]]:
        sock = self._ensure(lane)
        rid = next(self._ids).to_bytes(8, "little")
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        frames = encode(msg, tensors)

        async def roundtrip() -> tuple[Msg, list[torch.Tensor]]:
            await sock.send_multipart([rid, *frames], copy=False)
            return await fut

        nbytes = sum(t.nbytes for t in tensors)
        self._queued_bytes[lane] = queued = self._queued_bytes.get(lane, 0) + nbytes
        timeout_s = self.timeout_s + queued / SLOW_LINK_BYTES_PER_S
        try:
            reply, out = await asyncio.wait_for(roundtrip(), timeout_s)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"store {self.endpoint} did not answer {type(msg).__name__} "
                                   f"within {timeout_s:.0f}s") from None
        finally:
            self._pending.pop(rid, None)
            self._queued_bytes[lane] -= nbytes
        if isinstance(reply, Error):
            raise StoreError(reply.message, reply.code)
        return reply, out

    async def _ok(self, msg: Msg, tensors: Sequence[torch.Tensor] = (), lane: str = "main") -> Ok:
        reply, _ = await self._call(msg, tensors, lane)
        if not isinstance(reply, Ok):
            raise StoreError(f"unexpected reply {type(reply).__name__}", "bad_reply")
        return reply

    # ---------------------------------------------------------------- shared memory

    def _shm_failed(self, e: StoreError) -> bool:
        if "shm_unavailable" not in str(e):
            return False
        self.shm = False  # the server cannot see our segments: socket from now on
        return True

    async def _shm_put(self, hashes: list[bytes], blocks: list[torch.Tensor], model_id: str,
                       sums: list[int], flex: bool, keep_s: float, tenant: str) -> int | None:
        seg = self._segs.take(sum(aligned(b.numel() * b.element_size()) for b in blocks))
        if seg is None:
            return None
        try:
            refs = seg.write_blocks(blocks)
            try:
                return (await self._ok(ShmPut(hashes, seg.name, refs, model_id, sums, flex, keep_s, tenant,
                                                          current_traceparent()))).count
            except StoreError as e:
                if self._shm_failed(e):
                    return None
                raise
        except StoreUnavailable:
            self._segs.drop(seg)  # the store may still be at it: never reused
            raise
        finally:
            self._segs.give(seg)

    async def _shm_get(self, hashes: list[bytes], prefix: bool):
        seg = self._segs.take(self._get_hint)
        if seg is None:
            return None
        try:
            try:
                reply, frames = await self._call(ShmGet(hashes, seg.name, seg.size, prefix, current_traceparent()))
            except StoreError as e:
                if self._shm_failed(e):
                    return None
                raise
            if not isinstance(reply, ShmBlocks):
                raise StoreError(f"unexpected reply {type(reply).__name__}", "bad_reply")
            try:
                out = [seg.read(r.offset, r.spec) for r in reply.blocks] + frames
            except ValueError as e:
                raise StoreError(f"malformed reply: {e}", "bad_reply") from None
            if frames:  # did not all fit: ask for a bigger segment next time
                need = sum(aligned(t.numel() * t.element_size()) for t in out)
                self._get_hint = min(max(self._get_hint, need), self._segs.max_bytes // 2)
            return self._verified(reply.hashes, out, reply.checksums)
        except StoreUnavailable:
            self._segs.drop(seg)  # the store may still be at it: never reused
            raise
        finally:
            self._segs.give(seg)

    def _verified(self, hashes: list[bytes], blocks: list[torch.Tensor],
                  sums: list[int]) -> tuple[list[BlockHash], list[torch.Tensor]]:
        """The leading blocks that match the checksums they were stored with; the rest is a miss."""
        n = verified_prefix(blocks, sums)
        if n < len(blocks):
            log.warning("store %s returned %d blocks failing their checksums: treated as missing",
                        self.endpoint, len(blocks) - n)
            if self.on_corrupt is not None:
                self.on_corrupt(len(blocks) - n)
        return [BlockHash(h) for h in hashes[:n]], blocks[:n]

    # ---------------------------------------------------------------- object API

    async def put(self, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor] | torch.Tensor,
                  model_id: str = "", checksums: Sequence[int] = (), flex: bool = False, keep_s: float = 0.0,
                  tenant: str = "") -> int:
        """Store blocks (a ``[n, ...]`` tensor is n blocks); returns how many the store now holds.
        ``checksums`` (xxh3_64 per block, see ``mooncake.kv.integrity``; required): the store refuses blocks
        that differ, and a put without them;
        ``flex``: a flex request's blocks (the store evicts them first); ``keep_s``: a session's
        request's (kept that long, evicted last until then), ``tenant``'s (within its quota)."""
        hs = [bytes(h) for h in hashes]
        ts = _blocks_list(blocks)
        if len(hs) != len(ts):
            raise ValueError(f"{len(hs)} hashes for {len(ts)} blocks")
        if not hs:
            return 0
        if self.shm and sum(t.numel() * t.element_size() for t in ts) >= self.shm_min_bytes:
            n = await self._shm_put(hs, ts, model_id, list(checksums), flex, keep_s, tenant)
            if n is not None:
                return n
        return (await self._ok(Put(hs, [], model_id, list(checksums), flex, keep_s, tenant, current_traceparent()),
                               [t.detach() for t in ts], lane="puts")).count

    async def get(self, hashes: Sequence[BlockHash], prefix: bool = True) -> tuple[list[BlockHash], list[torch.Tensor]]:
        """Blocks found, in request order (``prefix``: only the leading run of present blocks)."""
        hs = [bytes(h) for h in hashes]
        if not hs:
            return [], []
        if self.shm:
            got = await self._shm_get(hs, prefix)
            if got is not None:
                return got
        reply, tensors = await self._call(Get(hs, prefix, current_traceparent()))
        if not isinstance(reply, Blocks):
            raise StoreError(f"unexpected reply {type(reply).__name__}", "bad_reply")
        return self._verified(reply.hashes, tensors, reply.checksums)

    async def get_layers(self, hashes: Sequence[BlockHash], layers_per_frame: int = 1
                         ) -> AsyncIterator[tuple[LayerSlices, torch.Tensor | None]]:
        """The leading run of present blocks, streamed layer by layer: ``(reply, kv)`` per
        ``layers_per_frame`` layers, ``kv`` ``[n, hi - lo, ...]``, the blocks' layer slices (None when nothing was
        found). Each reply waits at most ``timeout_s`` (then ``StoreUnavailable``); the caller
        verifies the blocks' checksums over all slices (``mooncake.kv.prefix_stream``)."""
        sock = self._ensure()
        rid = next(self._ids).to_bytes(8, "little")
        replies: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = replies
        try:
            await sock.send_multipart([rid, *encode(GetLayers([bytes(h) for h in hashes], layers_per_frame, current_traceparent()))],
                                      copy=False)
            while True:
                try:
                    item = await asyncio.wait_for(replies.get(), self.timeout_s)
                except asyncio.TimeoutError:
                    raise StoreUnavailable(f"store {self.endpoint} stopped streaming layers "
                                           f"(nothing within {self.timeout_s}s)") from None
                if isinstance(item, Exception):
                    raise item
                reply, tensors = item
                if isinstance(reply, Error):
                    raise StoreError(reply.message, reply.code)
                if not isinstance(reply, LayerSlices) or len(tensors) > 1:
                    raise StoreError(f"unexpected reply {type(reply).__name__} in a layer stream", "bad_reply")
                yield reply, (tensors[0] if tensors else None)
                if reply.last:
                    return
        finally:
            self._streams.pop(rid, None)

    async def exists(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return list((await self._ok(Exists([bytes(h) for h in hashes]))).flags)

    async def remove(self, hashes: Sequence[BlockHash]) -> int:
        return (await self._ok(Remove([bytes(h) for h in hashes], self.term))).count

    async def replicate(self, hashes: Sequence[BlockHash], target_endpoint: str) -> int:
        """Have the store copy these blocks (those it holds) to the store at ``target_endpoint``."""
        return (await self._ok(Replicate([bytes(h) for h in hashes], target_endpoint, self.term))).count

    async def keep(self, hashes: Sequence[BlockHash], keep_s: float, tenant: str = "") -> int:
        """Have the store keep these blocks (those it holds) for ``keep_s`` from now, for ``tenant``
        (within its quota); how many it holds."""
        return (await self._ok(Keep([bytes(h) for h in hashes], keep_s, tenant, self.term))).count

    async def stats(self) -> dict[str, Any]:
        return dict((await self._ok(StatsQuery())).data)

    def close(self) -> None:
        self._closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(StoreUnavailable("client closed"))
                fut.exception()  # a caller may already have given up on it: not an unhandled error
        self._pending.clear()
        for stream in self._streams.values():
            stream.put_nowait(StoreUnavailable("client closed"))
        for reader in self._readers:
            reader.cancel()
        self._readers.clear()
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._segs.close()
