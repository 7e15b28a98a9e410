"""What each request of the store's object API does to the tiered store: put (checksums checked,
kept to return with the blocks), get, exists, remove, stats, shared-memory put / get, and
replication of blocks to another store. Whatever may copy or touch LMDB runs in a worker thread.

``StoreRequests`` is a part of ``StoreServer`` (a mixin): the server decodes each request and
sends what ``_dispatch`` returns.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import torch

from ..kv.integrity import BlockSums, Rejections, checksums, first_corrupt
from ..protocol import (Blocks, Exists, Get, Msg, Ok, ProtocolError, Put, Remove, Replicate, ShmBlocks, ShmGet, ShmPut,
                        ShmRef, StatsQuery, encode)
from ..security import Curve
from .client import StoreClient, StoreError
from .shm import SegmentCache, aligned
from .tiered import TieredStore


class StoreRequests:
    """The store server's request handlers (see the module docstring)."""

    store: TieredStore
    sums: BlockSums
    rejections: Rejections
    curve: Curve | None
    node_id: str
    _peers: dict[str, StoreClient]
    _segments: SegmentCache
    _run: Callable[..., Awaitable[Any]]

    async def _dispatch(self, msg: Msg, tensors: list[torch.Tensor]) -> list:
        s = self.store
        if isinstance(msg, Put):
            if len(msg.hashes) != len(tensors):
                raise ProtocolError(f"{len(msg.hashes)} hashes for {len(tensors)} tensors")
            await self._run(self._verify, tensors, msg.checksums)
            self.sums.remember(msg.hashes, msg.checksums)
            return encode(Ok(count=await self._run(s.put_many, msg.hashes, tensors, msg.model_id)))
        if isinstance(msg, Get):
            found = await self._run(s.get_many, msg.hashes, msg.prefix)
            keys = [k for k, _ in found]
            return encode(Blocks(keys, [], self.sums.of(keys)), [b.tensor for _, b in found])
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
        self.sums.remember(msg.hashes, msg.checksums)
        return self.store.put_many(msg.hashes, views, msg.model_id)

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
        return ShmBlocks(keys, refs, checksums=self.sums.of(keys)), [b.tensor for _, b in found[n:]]

    def _verify(self, blocks: list[torch.Tensor], sums: list[int]) -> None:
        """Refuse a put whose blocks do not match the checksums they came with (when they came with any)."""
        bad = first_corrupt(blocks, sums) if sums else None
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
        by_model: dict[str, list[tuple[bytes, torch.Tensor]]] = {}
        for k, b in found:
            by_model.setdefault(b.model_id, []).append((k, b.tensor))
        n = 0
        try:
            for model_id, items in by_model.items():
                blocks = [t for _, t in items]
                n += await peer.put([k for k, _ in items], blocks, model_id, await self._run(checksums, blocks))
        except StoreError:
            self._peers.pop(msg.target, None)
            peer.close()
            raise
        return n
