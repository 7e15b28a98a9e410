"""A model's projections to a quantized scheme, in place: ``int8`` (``int8.py``) or ``int4``
(``int4.py``: the weights already on 4-bit groups stay 4-bit, the others int8)."""

from __future__ import annotations

import logging

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.kernels.native import load_int4_kernel, load_kernel
from mooncake.engine.model.families.spec import Fused, Linear, ModelSpec, Separate
from mooncake.engine.model.int4 import Int4Projection, int4_groups
from mooncake.engine.model.int8 import INT8_DTYPES, Int8Projection, QuantizedProjection

log = logging.getLogger(__name__)


def _quantized(proj: object, where: str, scheme: str, kernels: dict[type, object]) -> QuantizedProjection:
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
