"""What each request of the store's object API does to the tiered store: put (checksums required
and checked, kept to return with the blocks), get, exists, remove, stats, shared-memory put / get,
replication of blocks to another store, keeping a session's blocks, and the layer stream of ``GetLayers``. Whatever may copy or touch LMDB
runs in a worker thread of its own pool, so the event loop only moves frames.

``StoreServer`` owns a ``StoreRequests``: it decodes each request, passes it to ``handle`` (or
``stream_layers``) and sends what comes back.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import torch

from ..kv.integrity import Rejections, checksums, first_corrupt
from ..protocol import (Blocks, Exists, Get, GetLayers, Keep, LayerSlices, Msg, Ok, ProtocolError, Put, Remove, Replicate,
                        ShmBlocks, ShmGet, ShmPut, ShmRef, StatsQuery, encode)
from ..security import Curve
from .base import StoredBlock
from .client import StoreClient, StoreError
from .shm import SegmentCache, aligned
from .store_trace import traced_request
from .tiered import TieredStore
from .write_budget import WriteBudget

log = logging.getLogger(__name__)
# Fault injection for tests, read once at start: "die:N" (the process exits after sending N replies
# of its first layer stream) or "corrupt" (one byte of its first layer stream's first slice flips).
STREAM_FAULT_ENV = "MOONCAKE_FAULT_LAYER_STREAM"


class StoreRequests:
    """The store server's request handlers (see the module docstring). ``rejections`` counts the
    blocks of puts refused for a corrupt block or missing checksums."""

    def __init__(self, store: TieredStore, rejections: Rejections, node_id: str = "", curve: Curve | None = None,
                 workers: int = 4) -> None:
        self.store = store
        self.rejections = rejections
        self.node_id = node_id
        self.curve = curve
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="store-io")
        self._segments = SegmentCache()
        self._peers: dict[str, StoreClient] = {}
        self._stream_fault = os.environ.get(STREAM_FAULT_ENV, "")
        self.budget = WriteBudget(0)  # what each tenant may write per minute (the store role sets it)
        self.tracer: Any = None  # the store role's tracer ([observability]): traced requests get a span

    def close(self) -> None:
        """Close the replication clients, wait for the worker threads, unmap the segments."""
        for c in self._peers.values():
            c.close()
        self._peers.clear()
        self._pool.shutdown(wait=True)
        self._segments.close()

    async def _run(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def handle(self, msg: Msg, tensors: list[torch.Tensor]) -> list:
        """The reply (encoded frames) to one request (in a span when it carries a trace: ``store_trace.py``)."""
        trace = getattr(msg, "trace", None) if self.tracer is not None else None
        if trace:
            return await traced_request(self.tracer, self.store, msg, tensors, trace, self._handle)
        return await self._handle(msg, tensors)

    async def _handle(self, msg: Msg, tensors: list[torch.Tensor]) -> list:
        s = self.store
        if isinstance(msg, Put):
            if len(msg.hashes) != len(tensors):
                raise ProtocolError(f"{len(msg.hashes)} hashes for {len(tensors)} tensors")
            await self._run(self._verify, tensors, msg.checksums)
            n = self.budget.admit(msg.tenant, [t.nbytes for t in tensors])
            return encode(Ok(count=await self._run(s.put_many, msg.hashes[:n], tensors[:n], msg.model_id,
                                                   msg.checksums[:n], msg.flex, msg.keep_s, msg.tenant)))
        if isinstance(msg, Get):
            found = await self._run(s.get_many, msg.hashes, msg.prefix)
            keys = [k for k, _ in found]
            return encode(Blocks(keys, [], [b.checksum for _, b in found]), [b.tensor for _, b in found])
        if isinstance(msg, Exists):
            return encode(Ok(flags=s.exists(msg.hashes)))
        if isinstance(msg, Remove):
            return encode(Ok(count=await self._run(s.remove, msg.hashes)))
        if isinstance(msg, StatsQuery):
            data = await self._run(s.snapshot)
            data["node_id"] = self.node_id
            return encode(Ok(data=data))
        if isinstance(msg, Replicate):
            return encode(Ok(count=await self._replicate(msg)))
        if isinstance(msg, Keep):
            return encode(Ok(count=await self._run(s.keep, msg.hashes, msg.keep_s, msg.tenant)))
        if isinstance(msg, ShmPut):
            return encode(Ok(count=await self._run(self._shm_put, msg)))
        if isinstance(msg, ShmGet):
            head, rest = await self._run(self._shm_get, msg)
            return encode(head, rest)
        raise ProtocolError(f"the store does not serve {type(msg).__name__}")

    def _segment(self, name: str):
        try:
            return self._segments.get(name)
        except (OSError, ValueError) as e:
            raise StoreError(f"shm_unavailable: {e}") from None

    def _shm_put(self, msg: ShmPut) -> int:
        if len(msg.hashes) != len(msg.blocks):
            raise ProtocolError(f"{len(msg.hashes)} hashes for {len(msg.blocks)} blocks")
        seg = self._segment(msg.segment)
        try:
            views = [seg.view(r.offset, r.spec) for r in msg.blocks]
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        self._verify(views, msg.checksums)
        n = self.budget.admit(msg.tenant, [v.nbytes for v in views])
        return self.store.put_many(msg.hashes[:n], views[:n], msg.model_id, msg.checksums[:n], msg.flex, msg.keep_s,
                                   msg.tenant)

    def _shm_get(self, msg: ShmGet) -> tuple[ShmBlocks, list[torch.Tensor]]:
        seg = self._segment(msg.segment)
        found = self.store.get_many(msg.hashes, msg.prefix)
        refs: list[ShmRef] = []
        off, limit, n = 0, min(msg.size, seg.size), 0
        for _, block in found:
            nbytes = block.nbytes
            if off + nbytes > limit:
                break
            refs.append(ShmRef(off, seg.write(off, block.tensor)))
            off = aligned(off + nbytes)
            n += 1
        keys = [k for k, _ in found]
        return ShmBlocks(keys, refs, checksums=[b.checksum for _, b in found]), [b.tensor for _, b in found[n:]]

    def _verify(self, blocks: list[torch.Tensor], sums: list[int]) -> None:
        """Refuse a put whose blocks do not match the checksums they came with, or that came without
        (stored with checksum 0, they would be served unchecked), counting its blocks as refused."""
        if blocks and not sums:
            self.rejections.add("checksum", len(blocks))
            raise ProtocolError("put without checksums refused: send each block's xxh3_64 (mooncake.kv.integrity)")
        bad = first_corrupt(blocks, sums)
        if bad is not None:
            self.rejections.add("checksum", len(blocks))
            raise ProtocolError(f"block {bad} does not match its checksum: put refused")

    async def _replicate(self, msg: Replicate) -> int:
        found = await self._run(lambda: self.store.get_many(msg.hashes, count=False))
        if not found:
            return 0
        peer = self._peers.get(msg.target)
        if peer is None:
            peer = self._peers[msg.target] = StoreClient(msg.target, curve=self.curve)
        by_model: dict[str, list[tuple[bytes, StoredBlock]]] = {}
        for k, b in found:
            by_model.setdefault(b.model_id, []).append((k, b))
        n = 0
        try:
            for model_id, items in by_model.items():
                blocks = [b.tensor for _, b in items]
                sums = [b.checksum for _, b in items]  # the writer's: a copy corrupted here is refused there
                if not all(sums):
                    computed = await self._run(checksums, blocks)
                    sums = [s or c for s, c in zip(sums, computed)]
                n += await peer.put([k for k, _ in items], blocks, model_id, sums)
        except StoreError:
            self._peers.pop(msg.target, None)
            peer.close()
            raise
        return n

    async def stream_layers(self, msg: GetLayers) -> AsyncIterator[list]:
        """The replies to ``GetLayers``: one ``LayerSlices`` per ``layers_per_frame`` layers of the leading
        run of present blocks (of one shape and dtype), lowest layers first; each slice is copied out
        of the stored blocks in a worker thread just before it is sent, so the first layers leave at
        once. An error midway ends the stream (the server answers it with an ``Error`` reply)."""
        found = await self._run(self.store.get_many, msg.hashes, True)
        if found:
            first = found[0][1].tensor
            n = next((i for i, (_, b) in enumerate(found)
                      if b.tensor.shape != first.shape or b.tensor.dtype != first.dtype), len(found))
            found = found[:n]
        keys = [k for k, _ in found]
        sums = [b.checksum for _, b in found]
        blocks = [b.tensor for _, b in found]
        layers = blocks[0].shape[0] if blocks and blocks[0].dim() > 0 else 0
        step = max(1, msg.layers_per_frame)
        if not layers:
            yield encode(LayerSlices(keys, 0, 0, last=True))
            return
        for lo in range(0, layers, step):
            hi = min(layers, lo + step)
            part = await self._run(lambda lo=lo, hi=hi: torch.stack([b[lo:hi] for b in blocks]))
            fault, self._stream_fault = self._stream_fault, ""
            if fault == "corrupt":
                part.view(-1).view(torch.uint8)[0] ^= 1
            elif fault.startswith("die:") and lo // step >= int(fault[4:]):
                log.error("fault injection: the store dies mid-stream")
                os._exit(1)
            else:
                self._stream_fault = fault
            yield encode(LayerSlices(keys, lo, hi, checksums=sums, last=hi == layers), [part])
