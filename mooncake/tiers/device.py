"""Device tier: blocks in accelerator memory (CUDA when present, else CPU tensors)."""

from __future__ import annotations

import torch

from .memory import MemoryTier


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceTier(MemoryTier):
    name = "device"

    def __init__(self, capacity_bytes: int, device: torch.device | str | None = None) -> None:
        super().__init__(capacity_bytes, device=device or default_device(), pin=False)
