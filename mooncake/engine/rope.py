"""Rotary position embedding tables, including the config's ``rope_scaling``.

Supported rope types: ``default``, ``linear``, ``llama3``. Anything else is a
ModelLoadError (dynamic/yarn/longrope change frequencies with the context and
are not implemented).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mooncake.engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_params(config: Any) -> tuple[str, float, dict]:
    """(rope_type, theta, params) from a transformers config (v5 ``rope_parameters`` or v4 ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return rope_type, theta, params


def check_rope(config: Any) -> None:
    rope_type, _, _ = rope_params(config)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """The per-pair rotation frequencies (float32, ``[head_dim // 2]``)."""
    check_rope(config)
    rope_type, theta, p = rope_params(config)
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        freq = freq / float(p["factor"])
    elif rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq


def rope_tables(config: Any, head_dim: int, max_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin), each ``[max_len, head_dim]``.

    ``rope(x) = x * cos + roll(x, head_dim // 2) * signed_sin``, which equals the
    half-rotation form ``x * cos + rotate_half(x) * sin`` used by transformers.
    """
    freq = inv_freq(config, head_dim)
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = pos[:, None] * freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = head_dim // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos.to(device=device, dtype=dtype), signed.to(device=device, dtype=dtype)
