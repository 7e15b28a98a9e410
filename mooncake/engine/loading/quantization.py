"""Refusal, at load, of quantized checkpoints the engine's forward cannot run (it multiplies
plain float32/bfloat16/float16 weights), with a message that names the format.

Detected from ``config.json``'s ``quantization_config`` (``quant_method``, bitsandbytes'
``load_in_4bit``/``load_in_8bit``), from the side files quantizers write
(``quantize_config.json``, ``quant_config.json``), and from the safetensors headers
(tensor names such as ``qweight``, ``weight_scale``, ``SCB``; float8 dtypes). GGUF files
are not refused: they are dequantized to the serving dtype.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from mooncake.engine.errors import ModelLoadError

FORMAT_NAMES = {
    "awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8", "fbgemm_fp8": "FP8 (fbgemm)", "bitsandbytes": "bitsandbytes",
    "compressed-tensors": "compressed-tensors", "aqlm": "AQLM", "exl2": "EXL2", "hqq": "HQQ", "eetq": "EETQ",
    "quanto": "Quanto", "torchao": "torchao", "mxfp4": "MXFP4", "bitnet": "BitNet", "higgs": "HIGGS",
}
# tensor-name suffix -> format
_TENSOR_HINTS = {
    ".qweight": "AWQ or GPTQ", ".qzeros": "AWQ or GPTQ", ".g_idx": "GPTQ",
    ".weight_scale": "FP8", ".weight_scale_inv": "FP8", ".input_scale": "FP8",
    ".SCB": "bitsandbytes (8-bit)", ".absmax": "bitsandbytes (4-bit)", ".quant_map": "bitsandbytes (4-bit)",
}
_FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0")


def quantization_format(model_dir: Path) -> tuple[str, str] | None:
    """(format name, where it was seen) of a quantized HF directory, or None."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    qc = config.get("quantization_config") or config.get("compression_config")
    if isinstance(qc, dict) and qc:
        method = str(qc.get("quant_method") or "")
        if not method and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
            method = "bitsandbytes"
        return FORMAT_NAMES.get(method.lower(), method or "unknown"), "config.json quantization_config"
    for side, name in (("quantize_config.json", "GPTQ"), ("quant_config.json", "AWQ")):
        if (model_dir / side).is_file():
            return name, side
    for f in sorted(model_dir.glob("*.safetensors")):
        for tensor, dtype in _safetensors_header(f):
            if dtype in _FLOAT8_DTYPES:
                return "FP8", f"{f.name} (tensor {tensor} is {dtype})"
            for suffix, name in _TENSOR_HINTS.items():
                if tensor.endswith(suffix):
                    return name, f"{f.name} (tensor {tensor})"
    return None


def refuse_quantized(model_dir: Path) -> None:
    """ModelLoadError if ``model_dir`` holds a quantized checkpoint."""
    found = quantization_format(model_dir)
    if found is not None:
        name, where = found
        raise ModelLoadError(
            f"{model_dir} is a {name}-quantized checkpoint (seen in {where}); mooncake's engine runs "
            f"unquantized weights only (float32, bfloat16, float16): use the unquantized model, or a "
            f"GGUF file (converted to the serving dtype at load)")


def _safetensors_header(path: Path) -> list[tuple[str, str]]:
    """(tensor name, dtype) of each tensor in a safetensors file, from its JSON header."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                return []
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error):
        return []
    return [(k, str(v.get("dtype", ""))) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
