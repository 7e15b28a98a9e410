"""Weight-only int4 (``[model] quantization = "int4"``): a projection's weight stored in groups of
32 along its rows, 16 levels between the group's least and greatest value (a scale and an offset
per group: the layout of GGUF's Q4_1, so a model converted from a Q4_1 file gets back the file's
own values, up to the serving dtype's rounding; a Q4_0 file's symmetric groups are the same with
``zero = -8 * scale``). Only weights already on such groups are kept so (``int4_groups``);
``quantize.quantize_spec`` rounds the others to int8 rows.

As with int8 (``int8.py``), the float weights are overwritten by their dequantized values, the
float reference; calls with few rows read the packed nibbles (3/8 the bytes of bfloat16 with
the scales) with the engine's kernel (``[engine] int4_activations``: ``int4_vnni.c``, the
activations rounded to int8 per block of 32 and integer dot products with the nibbles, or
``quant_gemv.c``, each group unpacked to float32 once for up to 4 rows, float32 sums), others use
the dequantized weight.
Without the kernel (no AVX-512 VNNI) every call uses the dequantized weight: correct, and no
faster than unquantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncake.engine.kernels.native import Int4Gemv, load_int4_kernel
from mooncake.engine.model.int8 import INT8_MAX_ROWS, QuantizedProjection

GROUP = Int4Gemv.GROUP
INT4_MAX_ROWS = INT8_MAX_ROWS  # measured (2 threads, AVX-512): at 1-8 rows the int4 kernel beats int8's, and bf16 tiles


def _fit(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q ``[N, G, 32]`` uint8, scale, zero ``[N, G]``) for float32 groups ``g``: between the group's
    least and greatest value (Q4_1), or ``symmetric`` as llama.cpp writes Q4_0 (the value of
    greatest magnitude at level 0, ``scale = it / -8``, ``zero = -8 * scale``)."""
    if symmetric:
        top = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0]
        scale = top / -8
        zero = -8 * scale
    else:
        zero, high = g.amin(-1), g.amax(-1)
        scale = (high - zero) / 15
    safe = torch.where(scale.abs() < 1e-30, torch.ones_like(scale), scale)
    q = torch.round((g - zero[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return q, scale, zero


def _pack(q: torch.Tensor) -> torch.Tensor:
    N = q.shape[0]
    return (q[..., : GROUP // 2] | (q[..., GROUP // 2:] << 4)).reshape(N, -1).contiguous()


def quantize_groups(weight: torch.Tensor, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 ``[N, K/2]``, float32 scale and zero ``[N, K/32]``) with
    ``weight ≈ q * scale + zero`` per group of 32 along a row, ``q`` in 0..15 (``_fit``); a
    group's 16 bytes hold its elements 0-15 in the low nibbles, 16-31 in the high ones."""
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"int4 groups need rows of a multiple of {GROUP} values, not {K}")
    q, scale, zero = _fit(weight.detach().float().reshape(N, K // GROUP, GROUP), symmetric)
    return _pack(q), scale.contiguous(), zero.contiguous()


def int4_groups(weight: torch.Tensor, chunk_rows: int = 4096
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``quantize_groups(weight)`` where ``weight``'s rows already sit on int4 groups (a Q4_1 or
    Q4_0 file's values, up to the serving dtype's rounding; each group fitted either way), else
    None. On groups: every value within 1/8 of a step of a level, plus what rounding to the
    weight's dtype moved it (``eps`` of the group's largest magnitude). A full-precision
    weight's values fall anywhere between levels. ``chunk_rows`` at a time (a large lm_head's
    float32 copies stay small)."""
    N, K = weight.shape
    if K % GROUP:
        return None
    eps = torch.finfo(weight.dtype).eps
    parts = []
    for r0 in range(0, N, chunk_rows):
        g = weight[r0:r0 + chunk_rows].detach().float().reshape(-1, K // GROUP, GROUP)
        magnitude = g.abs().amax(-1)
        fits = []
        for symmetric in (False, True):
            q, scale, zero = _fit(g, symmetric)
            error = (q.float() * scale[..., None] + zero[..., None] - g).abs()
            fits.append((q, scale, zero, (error <= (scale.abs() / 8 + eps * magnitude)[..., None]).all(-1)))
        (q1, s1, z1, ok1), (q0, s0, z0, ok0) = fits
        if not bool((ok1 | ok0).all()):
            return None
        parts.append((_pack(torch.where(ok1[..., None], q1, q0)), torch.where(ok1, s1, s0), torch.where(ok1, z1, z0)))
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def dequantize_groups(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that ``quantize_groups``' output stands for."""
    N = packed.shape[0]
    b = packed.reshape(N, -1, GROUP // 2)
    q = torch.cat([b & 0x0F, b >> 4], -1).float()
    return (q * scale[..., None] + zero[..., None]).reshape(N, -1)


class Int4Projection(QuantizedProjection):
    max_rows = INT4_MAX_ROWS
    load_kernel = staticmethod(load_int4_kernel)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None,
                 kernel: Int4Gemv | None = None,
                 groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """``groups``: ``quantize_groups(weight)`` when already computed (``int4_groups``)."""
        self.w4, self.scale, self.zero = groups if groups is not None else quantize_groups(weight)
        with torch.no_grad():  # the float reference: the dequantized weight, in place
            weight.copy_(dequantize_groups(self.w4, self.scale, self.zero).to(weight.dtype))
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.kernel = kernel

    def small(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(flat.contiguous(), self.w4, self.scale, self.zero)
        return F.linear(flat, self.weight)
