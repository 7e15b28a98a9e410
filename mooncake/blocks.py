"""Block hashing: the keys under which KV blocks live everywhere in the cluster.

``h_i = sha256(h_{i-1} || int32 little-endian token bytes of block i)``,
with ``h_{-1}`` seeded by the model identity and an optional per-tenant
``cache_salt``. Only full blocks are keyed. Deterministic across processes and
restarts, so LMDB keys outlive the processes that wrote them.
"""

from __future__ import annotations

import hashlib
from typing import NewType, Sequence

import numpy as np

BlockHash = NewType("BlockHash", bytes)


def root_hash(model_id: str, cache_salt: str | None = None) -> BlockHash:
    """The chain's seed, ``h_{-1}``: model identity plus the tenant's salt."""
    seed = b"mooncake/v1\0" + model_id.encode()
    if cache_salt:
        seed += b"\0salt\0" + cache_salt.encode()
    return BlockHash(hashlib.sha256(seed).digest())


def hash_blocks(
    tokens: Sequence[int],
    block_tokens: int,
    model_id: str,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``tokens``; a partial tail is not keyed."""
    return extend_chain(root_hash(model_id, cache_salt), tokens, block_tokens)


def extend_chain(prev: BlockHash, tokens: Sequence[int], block_tokens: int) -> list[BlockHash]:
    """Continue a chain whose last hash is ``prev`` (the root for none) over the full blocks
    of ``tokens``, which start at a block boundary."""
    n_full = len(tokens) // block_tokens
    if n_full == 0:
        return []
    data = np.asarray(tokens[: n_full * block_tokens], dtype="<i4").tobytes()
    step = block_tokens * 4
    out: list[BlockHash] = []
    for i in range(n_full):
        h = hashlib.sha256(prev)
        h.update(data[i * step : (i + 1) * step])
        prev = BlockHash(h.digest())
        out.append(prev)
    return out
