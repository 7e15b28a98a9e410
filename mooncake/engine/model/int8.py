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
``quantize_spec`` quantizes a model's projections in either scheme.
"""

from __future__ import annotations

import abc
import logging

import torch
import torch.nn.functional as F

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.model.families.spec import Fused, Linear, ModelSpec, Separate
from mooncake.engine.kernels.native import MAX_K, Int8Gemv, load_int4_kernel, load_kernel

log = logging.getLogger(__name__)
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


def _quantized(proj: object, where: str, scheme: str, kernels: dict[type, object]) -> QuantizedProjection:
    from mooncake.engine.model.int4 import Int4Projection, int4_groups

    if isinstance(proj, Separate):
        raise ModelLoadError(f"{scheme} quantization needs fused projections ({where} mixes biased and unbiased parts)")
    if not isinstance(proj, (Fused, Linear)):
        raise ModelLoadError(f"{scheme} quantization cannot handle {type(proj).__name__} at {where}")
    sizes = proj.sizes if isinstance(proj, Fused) else None
    groups = int4_groups(proj.weight) if scheme == "int4" else None
    if groups is not None:
        return Int4Projection(proj.weight, proj.bias, sizes, kernels.get(Int4Projection), groups)  # type: ignore[arg-type]
    return Int8Projection(proj.weight, proj.bias, sizes, kernels.get(Int8Projection))  # type: ignore[arg-type]


def quantize_spec(spec: ModelSpec, use_kernel: bool = True, scheme: str = "int8", int4_activations: str = "float") -> None:
    """Every layer's projections and the lm_head (the tied embedding's bytes, the largest single
    matrix) to ``scheme``, in place (see the module doc). ``int4`` (``int4.py``) keeps in int4 the
    weights that already sit on its groups (a Q4_1 file's) and rounds the others to int8 rows:
    four bits per full-precision weight, uncalibrated, would lose too much. ``use_kernel=False``:
    torch's kernels instead of the engine's; ``int4_activations``: the int4 kernel's (``Int4Gemv``)."""
    from mooncake.engine.model.int4 import Int4Projection

    if scheme not in ("int8", "int4"):
        raise ModelLoadError(f"no quantization scheme {scheme!r}: int8 or int4")
    dtype, device = spec.embed.dtype, spec.embed.device
    if dtype not in INT8_DTYPES or device.type != "cpu":
        raise ModelLoadError(f"quantization '{scheme}' runs on CPU in bfloat16 or float32; this model serves "
                             f"{str(dtype).removeprefix('torch.')} on {device.type}: "
                             f"set dtype = \"bfloat16\" on a CPU or quantization = \"none\"")
    kernels = {Int8Projection: load_kernel(), Int4Projection: load_int4_kernel(activations=int4_activations)} if use_kernel else {}
    for i, layer in enumerate(spec.layers):
        layer.qkv = _quantized(layer.qkv, f"layer {i} qkv", scheme, kernels)
        layer.o = _quantized(layer.o, f"layer {i} o", scheme, kernels)
        layer.gate_up = _quantized(layer.gate_up, f"layer {i} gate_up", scheme, kernels)
        layer.down = _quantized(layer.down, f"layer {i} down", scheme, kernels)
    spec.head = _quantized(spec.head, "lm_head", scheme, kernels)
    if scheme == "int4":
        projections = [*(p for layer in spec.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)), spec.head]
        in_int4 = sum(isinstance(p, Int4Projection) for p in projections)
        (log.info if in_int4 else log.warning)(
            "int4: %d of %d projections on 4-bit groups, the rest (weights not on such groups) int8",
            in_int4, len(projections))
