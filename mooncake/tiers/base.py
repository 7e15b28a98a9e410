"""The tier interface: one medium (device memory, host DRAM, LMDB) holding KV blocks.

A tier is a plain keyed container with byte accounting. It knows nothing about
LRU order, eviction or other tiers; ``TieredStore`` decides what goes where.
Tiers are not thread-safe on their own: the store serialises access.

Values are ``StoredBlock``: an opaque tensor (any dtype/shape; the engine's
``[layers, 2, kv_heads, block_tokens, head_dim]``) plus the model identity.
A tensor returned by ``get`` must be treated as read-only by the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator, NamedTuple

import torch


class StoredBlock(NamedTuple):
    tensor: torch.Tensor
    model_id: str = ""
    checksum: int = 0  # xxh3_64 its writer sent with it (0: none), kept in every tier, on disk too

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def block_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def checked_capacity(capacity_bytes: int) -> int:
    """A tier's capacity, refused if negative."""
    if capacity_bytes < 0:
        raise ValueError("capacity_bytes must be >= 0")
    return capacity_bytes


class Tier(ABC):
    """A capacity-bounded block container (an interface: each tier holds its own state).
    ``used_bytes`` counts tensor bytes exactly."""

    name: str  # "device" | "dram" | "lmdb"
    capacity_bytes: int
    used_bytes: int

    @abstractmethod
    def put(self, key: bytes, block: StoredBlock) -> bool:
        """Store ``block`` under ``key`` (replacing any old value). False if it does not fit."""

    @abstractmethod
    def get(self, key: bytes) -> StoredBlock | None:
        """The block, or None when absent (or, for checked media, corrupt: then deleted)."""

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def delete(self, key: bytes) -> int:
        """Remove ``key``; returns the bytes freed (0 when absent)."""

    @abstractmethod
    def nbytes_of(self, key: bytes) -> int | None:
        """Accounted size of ``key`` without reading its data; None when absent."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every stored key (recovery after a restart; order unspecified)."""

    @abstractmethod
    def has_copy(self, key: bytes) -> bool:
        """A write-through copy of ``key`` is here (only a ``PersistentTier`` holds copies)."""

    @abstractmethod
    def close(self) -> None:
        """Release the medium (files, memory)."""

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(used={self.used_bytes}, capacity={self.capacity_bytes})"
