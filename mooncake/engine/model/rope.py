"""Rotary position embedding tables, including the config's ``rope_scaling``.

Supported rope types: ``default``, ``linear``, ``llama3``. Anything else is a
ModelLoadError (dynamic/yarn/longrope change frequencies with the context and
are not implemented). A family whose layers use different rope settings (Gemma 3:
local and global layers) gets one ``RopeParams`` per layer type.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from mooncake.engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RopeParams(NamedTuple):
    rope_type: str
    theta: float
    params: dict


def params_from_dict(params: dict | None, default_theta: float = 10000.0) -> RopeParams:
    """RopeParams from a v5 ``rope_parameters`` / v4 ``rope_scaling`` dict."""
    p = dict(params or {})
    theta = float(p.get("rope_theta", default_theta))
    return RopeParams(p.get("rope_type", p.get("type", "default")) or "default", theta, p)


def rope_params(config: Any) -> tuple[str, float, dict]:
    """(rope_type, theta, params) from a transformers config (v5 ``rope_parameters`` or v4 ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return tuple(params_from_dict(params, float(getattr(config, "rope_theta", 10000.0))))  # type: ignore[return-value]


def check_params(rp: RopeParams) -> None:
    if rp.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rp.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def check_rope(config: Any) -> None:
    check_params(RopeParams(*rope_params(config)))


def inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """The per-pair rotation frequencies (float32, ``[head_dim // 2]``)."""
    return inv_freq_of(RopeParams(*rope_params(config)), head_dim)


def inv_freq_of(rp: RopeParams, dim: int) -> torch.Tensor:
    """The per-pair rotation frequencies of ``rp`` over ``dim`` rotated dimensions."""
    check_params(rp)
    rope_type, theta, p = rp
    freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def tables_of(rp: RopeParams, dim: int, max_len: int, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin), each ``[max_len, dim]`` (``dim``: the rotated dimensions).

    ``rope(x) = x * cos + roll(x, dim // 2) * signed_sin``, which equals the
    half-rotation form ``x * cos + rotate_half(x) * sin`` used by transformers.
    """
    freq = inv_freq_of(rp, dim)
    pos = torch.arange(max_len, dtype=torch.int64).float()
    freqs = pos[:, None] * freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = dim // 2
    signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    return cos.to(device=device, dtype=dtype), signed.to(device=device, dtype=dtype)
