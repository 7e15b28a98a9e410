"""``[model] quantization = "auto"`` (the default): int4 weights where the source is a Q4_1 or Q4_0 GGUF,
int8 where it is another quantized GGUF, when the model serves in bfloat16 on a CPU the engine's
kernels run on; none elsewhere. The
GGUF's file type is read from its header alone; the conductor lets the first engine fix the choice."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from mooncake import protocol as P
from mooncake.config import ModelConfig
from mooncake.conductor.expected_model import ExpectedModel
from mooncake.engine.kernels.native import load_kernel
from mooncake.engine.loading.gguf_header import gguf_file_type, gguf_is_quantized
from mooncake.engine.loading.loader import default_model_path, model_variant, resolve_quantization

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _gguf(path: Path, file_type: int | None, version: int = 3) -> Path:
    """A GGUF header with metadata before the file type that the reader must skip: a string, an
    array of strings, an array of floats."""
    kv = [_string("general.architecture") + struct.pack("<I", 8) + _string("llama"),
          _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + b"".join(map(_string, ("a", "bc", "<s>"))),
          _string("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0.0, -1.0, -2.0)]
    if file_type is not None:
        kv.append(_string("general.file_type") + struct.pack("<II", 4, file_type))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(kv)) + b"".join(kv))
    return path


def test_the_file_type_is_read_from_the_header(tmp_path):
    assert gguf_file_type(default_model_path()) == 3  # the bundled SmolLM2 is Q4_1
    assert gguf_is_quantized(default_model_path())
    for file_type, quantized in ((0, False), (1, False), (32, False), (7, True), (15, True)):
        path = _gguf(tmp_path / f"m{file_type}.gguf", file_type)
        assert gguf_file_type(path) == file_type
        assert gguf_is_quantized(path) is quantized


def test_a_header_without_a_file_type_or_not_a_gguf_counts_as_not_quantized(tmp_path):
    assert gguf_file_type(_gguf(tmp_path / "none.gguf", None)) is None
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(_gguf(tmp_path / "whole.gguf", 3).read_bytes()[:40])
    assert gguf_file_type(truncated) is None
    assert gguf_file_type(_gguf(tmp_path / "v1.gguf", 3, version=1)) is None
    (tmp_path / "text.gguf").write_text("not a model")
    assert not gguf_is_quantized(tmp_path / "text.gguf")
    assert not gguf_is_quantized(tmp_path / "missing.gguf")


def test_auto_quantizes_only_a_quantized_gguf_in_bfloat16_on_a_cpu_with_the_kernel(tmp_path):
    bundled = ModelConfig()  # Q4_1: int4, the file's own groups; other quantized files: int8
    kernel = load_kernel() is not None
    assert resolve_quantization(bundled, torch.bfloat16, CPU) == ("int4" if kernel else "none")
    q8 = ModelConfig(path=str(_gguf(tmp_path / "q8.gguf", 7)))
    assert resolve_quantization(q8, torch.bfloat16, CPU) == ("int8" if kernel else "none")
    q4_0 = ModelConfig(path=str(_gguf(tmp_path / "q4_0.gguf", 2)))  # symmetric groups: int4's too
    assert resolve_quantization(q4_0, torch.bfloat16, CPU) == ("int4" if kernel else "none")
    assert resolve_quantization(bundled, torch.float32, CPU) == "none"  # token-exact stays exact
    assert resolve_quantization(bundled, torch.bfloat16, CUDA) == "none"
    f16 = ModelConfig(path=str(_gguf(tmp_path / "f16.gguf", 1)))
    assert resolve_quantization(f16, torch.bfloat16, CPU) == "none"  # full-precision weights stay so
    for chosen in ("none", "int8", "int4"):
        assert resolve_quantization(ModelConfig(quantization=chosen), torch.bfloat16, CPU) == chosen
    assert model_variant(bundled) == "" and model_variant(bundled, "int8") == "-int8"
    assert model_variant(bundled, "int4") == "-int4"


def test_the_conductor_lets_the_first_engine_fix_an_auto_quantization():
    shape = (30, 2, 3, 16, 64)
    auto = ExpectedModel("m@0123456789abcdef", None, 16, shape, "+kv_int8", any_quantization=True)
    none = ExpectedModel("m@0123456789abcdef", None, 16, shape, "+kv_int8")

    def facts(model_id: str) -> P.ModelFacts:
        return P.ModelFacts(model_id=model_id, block_tokens=16, max_model_len=2048, vocab_size=49152,
                            block_shape=shape)

    for dtype in ("bfloat16+kv_int8", "bfloat16-int8+kv_int8", "bfloat16-int4+kv_int8", "float32+kv_int8"):
        assert auto.problem(facts(f"m@0123456789abcdef/{dtype}")) is None
    assert "KV codec" in auto.problem(facts("m@0123456789abcdef/bfloat16-int8"))
    assert "quantization" in none.problem(facts("m@0123456789abcdef/bfloat16-int8+kv_int8"))


@pytest.mark.skipif(load_kernel() is None, reason="the engine's kernels do not run on this CPU")
def test_the_default_loads_the_bundled_q4_1_gguf_as_int4_in_bfloat16():
    from mooncake.engine import load_model

    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16"))
    assert loaded.quantization == "int4" and loaded.model_id.endswith("/bfloat16-int4")
