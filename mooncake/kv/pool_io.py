"""KV blocks into and out of an engine's paged pool: received KV written into a reserved
sequence (whole blocks or one layer at a time), a loading prefix landed layer by layer,
prefix blocks exported and imported, a sequence's blocks exported.

KV outside the pool is in the codec's wire form (``codec.py``: ``[n, *wire_shape]`` of
``wire_dtype``; with ``none``, the pool's own): what comes in is decoded on the pool's device,
what goes out is encoded there.

An ``Engine`` holds one ``PoolKV`` over its pool and block manager (``engine.kv``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mooncake.blocks import BlockHash
from mooncake.kv.codec import KVCodec

if TYPE_CHECKING:  # the engine imports this module: only types from it here
    from mooncake.engine.model.decoder import DecoderForward
    from mooncake.engine.kv_cache import BlockManager
    from mooncake.engine.sequence import Sequence


class PoolKV:
    """An engine's KV import / export (see the module docstring). Not thread-safe, as the engine."""

    def __init__(self, pool: torch.Tensor, blocks: BlockManager, model: DecoderForward, codec: KVCodec) -> None:
        self.pool, self.blocks, self.model, self.codec = pool, blocks, model, codec
        self.block_shape: tuple[int, ...] = model.block_shape
        self.wire_shape, self.wire_dtype = codec.wire_shape, codec.wire_dtype  # one block outside the pool
        self.block_tokens = model.block_tokens
        self.device, self.dtype = model.device, model.dtype

    def write_kv(self, seq: Sequence, first_block: int, kv: torch.Tensor, stage_row: int | None = None) -> None:
        """Copy received blocks ``[first_block, first_block + len(kv))`` into a reserved sequence;
        blocks it shares from the cache are left as they are. ``stage_row``: the decode workspace row the
        sequence will likely take at its first step; the KV is copied there too (``DecoderForward.stage``)."""
        n_blocks = len(seq.block_table)
        if first_block < 0 or first_block + len(kv) > n_blocks or seq.prefilled:
            raise ValueError("blocks %d..%d do not fit sequence %s of %d blocks"
                             % (first_block, first_block + len(kv), seq.req_id, n_blocks))
        self._check_kv(kv, 0)
        self._write_received(seq, first_block, kv, None, stage_row)

    def write_kv_layer(self, seq: Sequence, first_block: int, layer: int, kv: torch.Tensor,
                       stage_row: int | None = None) -> None:
        """Copy one layer of received blocks (``kv``: ``[n, *wire_shape[1:]]``) into a reserved sequence's
        blocks ``[first_block, first_block + n)``; blocks it shares from the cache are left as they are.
        ``stage_row``: as ``write_kv``'s."""
        n_blocks = len(seq.block_table)
        if first_block < 0 or first_block + len(kv) > n_blocks or seq.prefilled or not 0 <= layer < self.block_shape[0]:
            raise ValueError("layer %d of blocks %d..%d does not fit sequence %s of %d blocks"
                             % (layer, first_block, first_block + len(kv), seq.req_id, n_blocks))
        if kv.dim() != len(self.wire_shape) or tuple(kv.shape[1:]) != self.wire_shape[1:]:
            raise ValueError("kv layer has shape %s; expected [n, %s]" % (tuple(kv.shape), self.wire_shape[1:]))
        self._write_received(seq, first_block, kv, layer, stage_row)

    def _write_received(self, seq: Sequence, first_block: int, kv: torch.Tensor, layer: int | None,
                        stage_row: int | None) -> None:
        """Write checked received KV (all layers, or ``layer``) past the blocks ``seq`` shares from the cache."""
        skip = max(0, seq.num_cached_tokens // self.block_tokens - first_block)
        if stage_row is not None:  # all of it decoded: the workspace takes every block
            new = self.codec.decode(kv, self.device)
            self.model.stage(stage_row, seq.uid, len(seq.tokens), first_block, new, layer)
            new = new[skip:]
        elif skip < len(kv):
            new = self.codec.decode(kv[skip:], self.device)
        else:
            return
        if len(new):
            idx = self._tensor(seq.block_table[first_block + skip: first_block + len(kv)])
            if layer is None:
                self.pool.index_copy_(0, idx, new)
            else:
                self.pool[idx, layer] = new

    def _check_kv(self, kv: torch.Tensor, n: int) -> None:
        if kv.dim() != len(self.wire_shape) + 1 or tuple(kv.shape[1:]) != self.wire_shape or kv.shape[0] < n:
            raise ValueError("kv has shape %s; expected [>=%d, %s]" % (tuple(kv.shape), n, self.wire_shape))

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def export_blocks(self, hashes: list[BlockHash]) -> torch.Tensor:
        """``[n, *wire_shape]``: the leading blocks of ``hashes`` present in the device cache, encoded."""
        blocks = [self.blocks.cached[h] for h in hashes[: self.blocks.cached_prefix(hashes)]]
        self.blocks.touch(blocks)
        return self.codec.encode(self.pool[self._tensor(blocks)])

    def import_blocks(self, hashes: list[BlockHash], kv: torch.Tensor) -> int:
        """Store blocks (``kv``: encoded, ``[n, *wire_shape]``) as unreferenced cached blocks; already
        present ones count as stored.
        Stops at the first block that finds no free or evictable slot; returns how many."""
        self._check_kv(kv, len(hashes))
        held: list[int] = []
        new: list[int] = []
        new_hashes: list[BlockHash] = []
        src: list[int] = []
        for i, h in enumerate(hashes):
            if h in self.blocks.cached:
                held.extend(self.blocks.acquire([h]))
                continue
            got = self.blocks.allocate(1)
            if got is None:
                break
            held.extend(got)
            new.extend(got)
            new_hashes.append(h)
            src.append(i)
        if new:
            rows = self.codec.decode(kv[torch.tensor(src, device=kv.device)], self.device)
            self.pool.index_copy_(0, self._tensor(new), rows)
            self.blocks.register(new, new_hashes)
        self.blocks.release(held)
        return len(held)

    def land_layers(self, seq: Sequence, first_block: int, lo: int, kv: torch.Tensor) -> None:
        """Write layers ``[lo, lo + kv.shape[1])`` of a loading prefix (``kv``: ``[n, layers,
        *wire_shape[1:]]``) into the sequence's blocks ``[first_block, first_block + n)``. The one engine call that may
        run off the engine thread while a forward of ``seq`` runs: it touches only those blocks' pool
        rows, which that forward reads only after ``past_ready`` let it (and no bookkeeping). Layers
        with a non-finite scale are refused, nothing of them written (``KVCodec.first_nonfinite``)."""
        n, hi = len(kv), lo + kv.shape[1]
        if first_block < 0 or first_block + n > len(seq.block_table) or not 0 <= lo < hi <= self.block_shape[0]:
            raise ValueError("layers %d..%d of blocks %d..%d do not fit sequence %s of %d blocks"
                             % (lo, hi, first_block, first_block + n, seq.req_id, len(seq.block_table)))
        if tuple(kv.shape[2:]) != self.wire_shape[1:]:
            raise ValueError("kv layers have shape %s; expected [n, layers, %s]" % (tuple(kv.shape), self.wire_shape[1:]))
        if (bad := self.codec.first_nonfinite(kv)) is not None:  # the stream's loader counts it as such
            raise ValueError(f"block {bad} has non-finite scales in layers {lo}..{hi}: corrupt (a checksum failure)")
        idx = self._tensor(seq.block_table[first_block:first_block + n])
        self.pool[idx, lo:hi] = self.codec.decode(kv, self.device)

    def adopt_prefix(self, seq: Sequence, first_block: int, upto: int) -> None:
        """The loaded prefix blocks ``[first_block, upto)`` of ``seq`` are verified and whole: key them in
        the prefix cache (as if the sequence had computed them)."""
        self.blocks.register(seq.block_table[first_block:upto], seq.hashes[first_block:upto])
        seq.block_hashes = list(seq.hashes[:upto]) + seq.block_hashes[first_block:]

    def export_sequence(self, seq: Sequence, first_block: int = 0, last_block: int | None = None) -> torch.Tensor:
        """``[n, *wire_shape]``: the sequence's computed blocks ``[first_block, last_block)``,
        the partial tail included, encoded."""
        end = -(-seq.num_computed // self.block_tokens) if last_block is None else last_block
        blocks = self.pool[self._tensor(seq.block_table[first_block:end])]  # a copy
        tail = seq.num_computed - (end - 1) * self.block_tokens  # positions computed in the last block
        if not self.codec.lossless and len(blocks) and 0 < tail < self.block_tokens:
            blocks[-1, ..., tail:, :] = 0  # a reused block's stale positions would coarsen the scales
        return self.codec.encode(blocks)
