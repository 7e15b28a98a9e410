"""Weight-only int8 (``[model] quantization = "int8"``): each projection's weight is rounded to
int8 with one scale per output row (symmetric, absmax / 127).

The model's own float weights are overwritten in place by their dequantized values
(``int8 * scale``, in the serving dtype), so the transformers model and the engine's
large-row matmuls compute with exactly the weights the int8 kernel represents: that model
is the int8 engine's float reference. Calls with few rows (decode at small batch, where a
matmul is bound by reading its weight) use torch's int8 weight-packed matmul
(``aten._weight_int8pack_mm``: half the bytes of bf16); calls with more rows (prefill,
large decode batches, where bf16 tiles win) use the dequantized weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.families.spec import Fused, Linear, ModelSpec, Separate

INT8_MAX_ROWS = 8  # measured on AVX-512 BF16 (2 threads): int8 wins below 8 rows, bf16 from 8 on


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[N, K]``, float32 scale ``[N]``) with ``weight ≈ int8 * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous(), scale


class Int8Projection:
    """One or several fused projections over int8 weights; returns a tensor, or a tuple of
    views of ``sizes`` (as ``Fused``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None) -> None:
        self.w8, scale = quantize_rows(weight)
        self.scale = scale.to(weight.dtype)
        with torch.no_grad():  # the float reference: the dequantized weight, in place
            weight.copy_(self.w8.to(weight.dtype) * self.scale[:, None])
        self.weight, self.bias, self.sizes = weight, bias, sizes

    def __call__(self, h: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self.joint(h)
        return out.split(self.sizes, -1) if self.sizes is not None else out

    def joint(self, h: torch.Tensor) -> torch.Tensor:
        """The outputs side by side, unsplit (a fresh tensor the caller may write into)."""
        rows = h.numel() // h.shape[-1]
        if rows < INT8_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(h.reshape(rows, h.shape[-1]), self.w8, self.scale)
            out = out.view(*h.shape[:-1], -1)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(h, self.weight, self.bias)
        return out


def _int8(proj: object, where: str) -> Int8Projection:
    if isinstance(proj, Fused):
        return Int8Projection(proj.weight, proj.bias, proj.sizes)
    if isinstance(proj, Linear):
        return Int8Projection(proj.weight, proj.bias)
    if isinstance(proj, Separate):
        raise ModelLoadError(f"int8 quantization needs fused projections ({where} mixes biased and unbiased parts)")
    raise ModelLoadError(f"int8 quantization cannot handle {type(proj).__name__} at {where}")


def quantize_spec(spec: ModelSpec) -> None:
    """Every layer's projections and the lm_head to int8, in place (see the module doc)."""
    dtype, device = spec.embed.dtype, spec.embed.device
    if dtype != torch.bfloat16 or device.type != "cpu":
        raise ModelLoadError(f"quantization 'int8' runs on CPU in bfloat16 (torch's int8 weight-packed matmul); "
                             f"this model serves {str(dtype).removeprefix('torch.')} on {device.type}: "
                             f"set dtype = \"bfloat16\" on a CPU or quantization = \"none\"")
    for i, layer in enumerate(spec.layers):
        layer.qkv = _int8(layer.qkv, f"layer {i} qkv")
        layer.o = _int8(layer.o, f"layer {i} o")
        layer.gate_up = _int8(layer.gate_up, f"layer {i} gate_up")
        layer.down = _int8(layer.down, f"layer {i} down")
    spec.head = _int8(spec.head, "lm_head")
