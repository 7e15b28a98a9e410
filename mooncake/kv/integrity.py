"""KV block integrity: a checksum from the process that computed a block, checked by every
process that admits it, and the shape/dtype/hash checks that go with it.

A block's checksum is xxh3_64 over its raw bytes (fast enough to run on every transfer).
The prefill computes it when it exports KV; the decode verifies it before writing the KV
into its pool; a store verifies it on put; a prefill reading a store checks that the
blocks are the ones it asked for, in the model's block shape and dtype. Whatever fails is
a miss (the KV is recomputed), counted by reason in ``Rejections``, never served. Encoded blocks
with a NaN or infinite scale count as failing their checksum (``first_nonfinite``).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

import torch
import xxhash

if TYPE_CHECKING:
    from mooncake.kv.codec import KVCodec


def block_checksum(block: torch.Tensor) -> int:
    """xxh3_64 of a block's bytes (any dtype, any device)."""
    t = block.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    raw = t.contiguous().view(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest(memoryview(raw.numpy()))


def checksums(blocks: Sequence[torch.Tensor] | torch.Tensor) -> list[int]:
    return [block_checksum(b) for b in blocks]


def first_corrupt(blocks: Sequence[torch.Tensor], sums: Sequence[int]) -> int | None:
    """Index of the first block whose bytes do not match its checksum (a missing checksum
    counts as a mismatch); None when all match."""
    for i, b in enumerate(blocks):
        if i >= len(sums) or block_checksum(b) != sums[i]:
            return i
    return None


def first_nonfinite(blocks: Sequence[torch.Tensor], codec: KVCodec) -> int | None:
    """Index of the first encoded block (or frame of blocks) that would decode to NaN or infinity
    (``KVCodec.first_nonfinite``): corrupt, as one failing its checksum; None when none would."""
    for i, b in enumerate(blocks):
        if codec.first_nonfinite(b.unsqueeze(0)) is not None:
            return i
    return None


def shape_problem(blocks: Sequence[torch.Tensor], block_shape: Sequence[int], dtype: torch.dtype) -> str | None:
    """Why ``blocks`` are not KV blocks of this model (shape and dtype), or None."""
    for b in blocks:
        if tuple(b.shape) != tuple(block_shape) or b.dtype != dtype:
            return f"block {b.dtype}{list(b.shape)} is not a {dtype}{list(block_shape)} block"
    return None


def leading_match(asked: Sequence[bytes], got: Sequence[bytes]) -> int:
    """How many of the returned hashes are, in order, the leading ones asked for."""
    n = 0
    for a, g in zip(asked, got):
        if bytes(a) != bytes(g):
            break
        n += 1
    return n


def verified_prefix(blocks: Sequence[torch.Tensor], sums: Sequence[int]) -> int:
    """How many leading blocks match their checksums (0 or absent: not known, not checked)."""
    for i, b in enumerate(blocks):
        if i < len(sums) and sums[i] and block_checksum(b) != sums[i]:
            return i
    return len(blocks)


class Rejections:
    """KV refused by this process, by reason (reported in heartbeats, exported as a metric)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, reason: str, blocks: int = 1) -> None:
        self.counts[reason] += blocks

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
