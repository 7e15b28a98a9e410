"""KV codecs: how a KV block looks outside an engine's pool (``[model] kv_codec``).

A block leaves an engine encoded (for a decode instance, for a store), stays encoded on the
wire and in every store tier, and is decoded where it lands in an engine's pool. The pool
itself computes in the serving dtype.

- ``none``: the pool's own bytes (``[layers, 2, kv_heads, T, head_dim]`` in the serving dtype).
- ``int8``: each channel (``head_dim`` position) of one layer's K or V of one head is scaled over
  the block's ``T`` positions by its absolute maximum onto -127..127 and rounded (per-channel
  scales: K's outlier channels then cost the others no precision; on SmolLM2's KV, relative
  error 0.3% for K and 0.5% for V, against 1.3% and 1.1% with one scale per head and block).
- ``fp8``: the same channels scaled onto float8 e4m3's range (±448) and cast.

An encoded block is one ``uint8`` tensor ``[layers, 2, kv_heads, T * head_dim + 2 * head_dim]``:
per (layer, K/V, head), the ``T * head_dim`` codes, then ``head_dim`` float16 scales (12.5% more
than the codes at ``T = 16``: 0.56x the bytes of bfloat16, 0.28x of float32). The codes are
computed against the float16-rounded scales, so rounding the scales costs nothing. Layer ``l`` is
still ``block[l]``, so layer-wise transfers and a store's layer slices cut it as before, and the
integrity checksum covers the scales with the codes. Encoding runs on the pool's device (a GPU
pool sends fewer bytes over PCIe too); both directions are a handful of vectorised torch ops over
all blocks at once, on the engine or a worker thread, never the event loop.

A block with a NaN or infinite scale (or an fp8 NaN code) is corrupt even where its checksum
matches: decoded, it would poison every prompt that reuses it, so whatever admits encoded KV
refuses it as a checksum failure, a miss that is recomputed (``first_nonfinite``).

The codec is part of the model id (``loader.model_variant``), so blocks of different codecs have
different hashes and never mix, and an engine of another codec cannot join the cluster.
"""

from __future__ import annotations

import math

import torch

KV_CODECS = ("none", "int8", "fp8")
SCALE_DTYPE = torch.float16  # one scale per channel
MIN_SCALE = 2.0 ** -14  # float16's smallest normal: a near-silent channel keeps a usable scale
MAX_SCALE = 65504.0  # float16's largest: a channel past 127 (448) times it saturates, never turns inf
ENCODE_BLOCKS = 32  # blocks encoded at a time: the float32 working copy stays small on a full GPU

_RANGE = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each code holds


def fp8_available() -> bool:
    """torch here can cast to float8 e4m3."""
    return hasattr(torch, "float8_e4m3fn")


class KVCodec:
    """The encoding of one model's KV blocks (see the module docstring). ``block_shape``: the pool's
    ``[layers, 2, kv_heads, T, head_dim]``; ``dtype``: the pool's."""

    def __init__(self, name: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if name not in KV_CODECS:
            raise ValueError(f"unknown kv_codec {name!r}; known: {', '.join(KV_CODECS)}")
        if name == "fp8" and not fp8_available():
            raise ValueError("kv_codec fp8 needs a torch with float8_e4m3fn")
        self.name, self.block_shape, self.dtype = name, tuple(block_shape), dtype
        *lead, t, d = self.block_shape
        self._row, self._d = t * d, d
        if name == "none":
            self.wire_shape, self.wire_dtype = self.block_shape, dtype
        else:
            self.wire_shape, self.wire_dtype = (*lead, self._row + 2 * d), torch.uint8
        self.wire_block_bytes = math.prod(self.wire_shape) * torch.empty(0, dtype=self.wire_dtype).element_size()

    @property
    def lossless(self) -> bool:
        return self.name == "none"

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        """``[..., T, head_dim]`` KV in the pool's layout (whole blocks, one layer of blocks, or
        several layers) as ``[..., T * head_dim + 2 * head_dim]`` bytes; ``none``: ``kv`` itself."""
        if self.name == "none":
            return kv
        if kv.dim() > 3 and len(kv) > ENCODE_BLOCKS:
            return torch.cat([self.encode(part) for part in kv.split(ENCODE_BLOCKS)])
        x = kv.to(torch.float32, copy=True)  # scaled in place below; the pool is never written
        amax = x.abs().amax(dim=-2, keepdim=True)  # [..., 1, D]: per channel over the block's positions
        scale = (amax / _RANGE[self.name]).clamp_(MIN_SCALE, MAX_SCALE).to(SCALE_DTYPE)
        x.div_(scale.float())
        if self.name == "int8":
            codes = x.round_().clamp_(-127, 127).to(torch.int8)
        else:
            codes = x.clamp_(-448, 448).to(torch.float8_e4m3fn)
        lead = kv.shape[:-2]
        return torch.cat((codes.view(torch.uint8).reshape(*lead, self._row),
                          scale.view(torch.uint8).reshape(*lead, 2 * self._d)), dim=-1)

    def first_nonfinite(self, enc: torch.Tensor) -> int | None:
        """Index along the first dimension of encoded ``enc`` (blocks, or layers of blocks) of the
        first that holds a NaN or infinite scale or an fp8 NaN code; None when all decode finite."""
        if self.lossless or not len(enc):
            return None
        ok = enc[..., self._row:].contiguous().view(SCALE_DTYPE).isfinite().reshape(len(enc), -1).all(dim=1)
        if self.name == "fp8":  # e4m3fn has no infinity; NaN is S.1111.111
            ok &= ((enc[..., :self._row] & 0x7F) != 0x7F).reshape(len(enc), -1).all(dim=1)
        bad = (~ok).nonzero()
        return int(bad[0]) if len(bad) else None

    def decode(self, enc: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """Encoded ``[..., T * head_dim + 2 * head_dim]`` bytes as ``[..., T, head_dim]`` KV in the pool's
        dtype, on ``device`` (default: where ``enc`` is; the bytes move before they are decoded)."""
        if device is not None:
            enc = enc.to(device, non_blocking=True)
        if self.name == "none":
            return enc.to(self.dtype)
        *lead, width = enc.shape
        if width != self._row + 2 * self._d or enc.dtype != torch.uint8:
            raise ValueError(f"{enc.dtype}{list(enc.shape)} is not {self.name}-encoded KV of this model")
        t, d = self.block_shape[-2:]
        codes = enc[..., :self._row].reshape(*lead, t, d)
        scale = enc[..., self._row:].contiguous().view(SCALE_DTYPE).unsqueeze(-2)  # [..., 1, D]
        values = codes.view(torch.int8) if self.name == "int8" else codes.view(torch.float8_e4m3fn)
        return values.float().mul_(scale.float()).to(self.dtype)
