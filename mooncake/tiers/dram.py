"""DRAM tier: blocks in host memory, pinned when CUDA is present (fast H2D/D2H)."""

from __future__ import annotations

import torch

from .memory import MemoryTier


class DramTier(MemoryTier):
    name = "dram"

    def __init__(self, capacity_bytes: int, recycle: bool = True) -> None:
        super().__init__(capacity_bytes, device="cpu", pin=torch.cuda.is_available(), recycle=recycle)
