"""Weight-only int8 (``[model] quantization = "int8"``): each projection's weight is rounded to
int8 with one scale per output row (symmetric, absmax / 127).

The model's own float weights are overwritten in place by their dequantized values
(``int8 * scale``, in the serving dtype), so the transformers model and the engine's
large-row matmuls compute with exactly the weights the int8 kernel represents: that model
is the int8 engine's float reference. Calls with few rows (decode at small batch, where a
matmul is bound by reading its weight) read the int8 weight (half the bytes of bf16) with the
engine's own kernel (``native.py``: float32-accurate sums, 2-3x torch's bandwidth here),
else torch's int8 weight-packed matmul (``aten._weight_int8pack_mm``); calls with more rows
(prefill, large decode batches, where bf16 tiles win) use the dequantized weight. Serving
dtype bfloat16, or float32 (slower; the float reference's own arithmetic, for exactness tests).
``QuantizedProjection`` is that split by row count, shared with int4 (``int4.py``);
``quantize.py`` quantizes a model's projections in either scheme.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from mooncake.engine.kernels.native import MAX_K, Int8Gemv, load_kernel

INT8_DTYPES = (torch.bfloat16, torch.float32)
INT8_MAX_ROWS = 8  # measured on AVX-512 BF16 (2 threads): int8 wins below 8 rows, bf16 from 8 on


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[N, K]``, float32 scale ``[N]``) with ``weight ≈ int8 * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous(), scale


class QuantizedProjection(abc.ABC):
    """One or several fused projections over quantized weights; returns a tensor, or a tuple of
    views of ``sizes`` (as ``Fused``). ``weight`` holds the dequantized values (the float
    reference); calls with fewer than ``max_rows`` rows go to ``small``."""

    max_rows = INT8_MAX_ROWS
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int] | None

    def __call__(self, h: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self.joint(h)
        return out.split(self.sizes, -1) if self.sizes is not None else out

    def joint(self, h: torch.Tensor) -> torch.Tensor:
        """The outputs side by side, unsplit (a fresh tensor the caller may write into)."""
        rows = h.numel() // h.shape[-1]
        if rows >= self.max_rows:
            return F.linear(h, self.weight, self.bias)
        out = self.small(h.reshape(rows, h.shape[-1])).view(*h.shape[:-1], -1)
        return out + self.bias if self.bias is not None else out

    @abc.abstractmethod
    def small(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat [rows, K]`` (fewer than ``max_rows``) through the quantized weights, bias not added."""


class Int8Projection(QuantizedProjection):
    load_kernel = staticmethod(load_kernel)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None,
                 kernel: Int8Gemv | None = None) -> None:
        self.w8, self.scale32 = quantize_rows(weight)
        self.scale = self.scale32.to(weight.dtype)
        with torch.no_grad():  # the float reference: the dequantized weight, in place
            weight.copy_(self.w8.to(weight.dtype) * self.scale[:, None])
        self.weight, self.bias, self.sizes = weight, bias, sizes
        K = weight.shape[1]
        self.kernel = kernel if kernel is not None and K % 32 == 0 and K <= MAX_K else None

    def small(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(flat.contiguous(), self.w8, self.scale32)
        return torch.ops.aten._weight_int8pack_mm(flat, self.w8, self.scale)
