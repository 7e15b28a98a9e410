"""A model's projections to a quantized scheme, in place: ``int8`` (``int8.py``) or ``int4``
(``int4.py``: the weights already on 4-bit groups stay 4-bit, the others int8). In either, given
the GGUF a model was converted from, the file's Q8_0 weights are served as stored (``q8.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.kernels.native import load_int4_kernel, load_kernel, load_q8_kernel
from mooncake.engine.loading.gguf_blocks import Q8Blocks, q8_0_blocks
from mooncake.engine.model.families.spec import Fused, Linear, ModelSpec, Separate
from mooncake.engine.model.int4 import Int4Projection, int4_groups
from mooncake.engine.model.int8 import INT8_DTYPES, Int8Projection, QuantizedProjection
from mooncake.engine.model.q8 import Q8Projection, holds_q8

log = logging.getLogger(__name__)


def _quantized(proj: object, where: str, scheme: str, kernels: dict[type, object],
               q8: dict[str, Q8Blocks]) -> QuantizedProjection:
    if isinstance(proj, Separate):
        raise ModelLoadError(f"{scheme} quantization needs fused projections ({where} mixes biased and unbiased parts)")
    if not isinstance(proj, (Fused, Linear)):
        raise ModelLoadError(f"{scheme} quantization cannot handle {type(proj).__name__} at {where}")
    sizes = proj.sizes if isinstance(proj, Fused) else None
    blocks = q8.get(where)
    if blocks is not None:
        if holds_q8(proj.weight, *blocks):
            return Q8Projection(proj.weight, proj.bias, sizes, kernels.get(Q8Projection), blocks)  # type: ignore[arg-type]
        log.warning("%s: the GGUF's Q8_0 blocks are not the converted weight's values; quantizing it instead", where)
    groups = int4_groups(proj.weight) if scheme == "int4" else None
    if groups is not None:
        return Int4Projection(proj.weight, proj.bias, sizes, kernels.get(Int4Projection), groups)  # type: ignore[arg-type]
    return Int8Projection(proj.weight, proj.bias, sizes, kernels.get(Int8Projection))  # type: ignore[arg-type]


def quantize_spec(spec: ModelSpec, use_kernel: bool = True, scheme: str = "int8", int4_activations: str = "float",
                  gguf: Path | None = None) -> None:
    """Every layer's projections and the lm_head (the tied embedding's bytes, the largest single
    matrix) to ``scheme``, in place (see the module doc). ``int4`` (``int4.py``) keeps in int4 the
    weights that already sit on its groups (a Q4_1 file's) and rounds the others to int8 rows:
    four bits per full-precision weight, uncalibrated, would lose too much. ``gguf``: the file the
    model was converted from; its Q8_0 weights are served as stored, in either scheme (``q8.py``).
    ``use_kernel=False``: torch's kernels instead of the engine's; ``int4_activations``: the int4
    kernel's (``Int4Gemv``)."""
    if scheme not in ("int8", "int4"):
        raise ModelLoadError(f"no quantization scheme {scheme!r}: int8 or int4")
    dtype, device = spec.embed.dtype, spec.embed.device
    if dtype not in INT8_DTYPES or device.type != "cpu":
        raise ModelLoadError(f"quantization '{scheme}' runs on CPU in bfloat16 or float32; this model serves "
                             f"{str(dtype).removeprefix('torch.')} on {device.type}: "
                             f"set dtype = \"bfloat16\" on a CPU or quantization = \"none\"")
    kernels = {Int8Projection: load_kernel(), Int4Projection: load_int4_kernel(activations=int4_activations),
               Q8Projection: load_q8_kernel()} if use_kernel else {}
    q8 = q8_0_blocks(gguf, spec.num_heads, spec.num_kv_heads) if gguf is not None else {}
    for i, layer in enumerate(spec.layers):
        layer.qkv = _quantized(layer.qkv, f"layer {i} qkv", scheme, kernels, q8)
        layer.o = _quantized(layer.o, f"layer {i} o", scheme, kernels, q8)
        layer.gate_up = _quantized(layer.gate_up, f"layer {i} gate_up", scheme, kernels, q8)
        layer.down = _quantized(layer.down, f"layer {i} down", scheme, kernels, q8)
    spec.head = _quantized(spec.head, "lm_head", scheme, kernels, q8)
    projections = [*(p for layer in spec.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)), spec.head]
    in_q8 = sum(isinstance(p, Q8Projection) for p in projections)
    if scheme == "int4":
        in_int4 = sum(isinstance(p, Int4Projection) for p in projections)
        (log.info if in_int4 else log.warning)(
            "int4: %d of %d projections on 4-bit groups, %d the GGUF's Q8_0 as stored, the rest (weights on "
            "neither) int8", in_int4, len(projections), in_q8)
    elif gguf is not None:
        log.info("int8: %d of %d projections the GGUF's Q8_0 as stored, the rest int8 rows", in_q8, len(projections))
