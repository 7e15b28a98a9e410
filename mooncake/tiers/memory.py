"""In-memory tiers (device memory, host DRAM): one tensor per block, freed block tensors recycled.

Measured (benchmarks/bench_store.py, "dram layout"): allocating a fresh tensor
per put costs page faults (glibc hands big blocks back to the OS), which makes
puts 3-5x slower than copying into preallocated memory. A single arena with
slot reuse is as fast, but a reused slot can be overwritten while a reader
(e.g. ZeroMQ sending with ``copy=False``) still holds a view of it. So each
block owns its tensor, and a freed tensor is recycled into a per-(dtype, shape)
free list only when nobody else references it. Memory held (blocks + free
list) never exceeds the capacity.
"""

from __future__ import annotations

import sys
from typing import Iterator

import torch

from .base import StoredBlock, Tier, block_nbytes, checked_capacity


def _storage_users(t: torch.Tensor) -> int:
    """Holders of ``t``'s storage, or a large number when torch cannot tell."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return 1 << 30
    return int(counter(t.untyped_storage()._cdata)) - 1  # minus the temporary storage object


class MemoryTier(Tier):
    """Blocks as tensors on ``device``; ``pin`` allocates pinned host memory (CUDA only)."""

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu", pin: bool = False,
                 recycle: bool = True) -> None:
        self.capacity_bytes, self.used_bytes = checked_capacity(capacity_bytes), 0
        self.device = torch.device(device)
        self.pin = bool(pin and self.device.type == "cpu" and torch.cuda.is_available())
        self.recycle = recycle
        self._blocks: dict[bytes, StoredBlock] = {}
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._free_bytes = 0

    # ---- allocation

    def _alloc(self, like: torch.Tensor) -> torch.Tensor:
        shape, n = tuple(like.shape), block_nbytes(like)
        pool = self._free.get((like.dtype, shape))
        if pool:
            self._free_bytes -= n
            t = pool.pop()
            if not pool:  # no empty lists: the loop below pops from whichever list comes first
                del self._free[(like.dtype, shape)]
            return t
        # keep blocks + free list within capacity: drop recycled tensors of other shapes
        while self._free and self.used_bytes + self._free_bytes + n > self.capacity_bytes:
            key = next(iter(self._free))
            dropped = self._free[key].pop()
            self._free_bytes -= block_nbytes(dropped)
            if not self._free[key]:
                del self._free[key]
        return torch.empty(shape, dtype=like.dtype, device=self.device, pin_memory=self.pin)

    def _recycle(self, t: torch.Tensor) -> None:
        # references: the caller's local, this parameter, getrefcount's argument
        if not self.recycle or sys.getrefcount(t) > 3 or _storage_users(t) != 1:
            return
        n = block_nbytes(t)
        if self.used_bytes + self._free_bytes + n > self.capacity_bytes:
            return
        self._free.setdefault((t.dtype, tuple(t.shape)), []).append(t)
        self._free_bytes += n

    # ---- Tier

    def put(self, key: bytes, block: StoredBlock) -> bool:
        n = block.nbytes
        self.delete(key)
        if not self.fits(n):
            return False
        src = block.tensor
        t = self._alloc(src)
        t.copy_(src.reshape(t.shape) if not src.is_contiguous() else src)
        self._blocks[key] = block._replace(tensor=t)
        self.used_bytes += n
        return True

    def get(self, key: bytes) -> StoredBlock | None:
        return self._blocks.get(key)

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def delete(self, key: bytes) -> int:
        b = self._blocks.pop(key, None)
        if b is None:
            return 0
        t = b.tensor
        del b
        n = block_nbytes(t)
        self.used_bytes -= n
        self._recycle(t)
        return n

    def nbytes_of(self, key: bytes) -> int | None:
        b = self._blocks.get(key)
        return None if b is None else b.nbytes

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._blocks))

    def has_copy(self, key: bytes) -> bool:
        return False  # copies are a persistent tier's

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        self._blocks.clear()
        self._free.clear()
        self._free_bytes = 0
        self.used_bytes = 0


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(MemoryTier):
    """Blocks in accelerator memory (CUDA when present, else CPU tensors)."""

    name = "device"

    def __init__(self, capacity_bytes: int, device: torch.device | str | None = None) -> None:
        super().__init__(capacity_bytes, device=device or default_device(), pin=False)


class DramTier(MemoryTier):
    """Blocks in host memory, pinned when CUDA is present (fast H2D/D2H)."""

    name = "dram"

    def __init__(self, capacity_bytes: int, recycle: bool = True) -> None:
        super().__init__(capacity_bytes, device="cpu", pin=torch.cuda.is_available(), recycle=recycle)
