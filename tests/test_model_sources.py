"""Where models come from: Hugging Face repo ids from the local cache (no network), served
names, GGUF converted to the serving dtype, quantized checkpoints refused by name; CLI flags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_cache import COMMIT, hf_cache_with
from mooncake.cli import _overrides, main as cli_main
from mooncake.config import ModelConfig, load_config
from mooncake.engine import ModelLoadError, load_model
from mooncake.engine.loading.hub_cache import hub_cache_dir, is_repo_id
from mooncake.engine.loading.loader import default_model_path, resolve_model_dir
from mooncake.engine.loading.quantization import _safetensors_header

def test_repo_id_resolves_from_the_local_cache(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = hf_cache_with(tiny_models["qwen3"], tmp_path / "hub", "tiny-org/tiny-qwen3")
    assert resolve_model_dir(ModelConfig(path="tiny-org/tiny-qwen3")) == (snap, "tiny-org/tiny-qwen3")
    loaded = load_model(ModelConfig(path="tiny-org/tiny-qwen3", device="cpu"))
    assert loaded.name == "tiny-org/tiny-qwen3" and loaded.model_dir == snap
    assert loaded.model_id.startswith("tiny-org/tiny-qwen3@")
    # a snapshot directory given as a path serves under the repo id too, not the commit hash
    assert resolve_model_dir(ModelConfig(path=str(snap)))[1] == "tiny-org/tiny-qwen3"
    # --served-model-name wins
    assert resolve_model_dir(ModelConfig(path="tiny-org/tiny-qwen3", name="mine"))[1] == "mine"


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"
    assert is_repo_id("Qwen/Qwen3-0.6B") and is_repo_id("google/gemma-2-2b-it")
    assert not any(map(is_repo_id, ["./x/y", "/abs/path", "a/b/c", "../a", "model.gguf", "org/"]))


def test_repo_id_absent_from_the_cache_names_the_cache(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match=rf"'nobody/nothing' is not in the local Hugging Face cache {tmp_path}/hub"):
        resolve_model_dir(ModelConfig(path="nobody/nothing"))
    hf_cache_with(tiny_models["phi3"], tmp_path / "hub", "org/two", ref=False)
    hf_cache_with(tiny_models["phi3"], tmp_path / "hub", "org/two", commit="f" * 40, ref=False)
    with pytest.raises(ModelLoadError, match="2 snapshots and no refs/main"):
        resolve_model_dir(ModelConfig(path="org/two"))


def test_cli_flags_become_config(tmp_path):
    import argparse

    from mooncake.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--dev", "--model", "Qwen/Qwen3-0.6B", "--served-model-name", "qwen",
                              "--max-model-len", "4096"])
    cfg = load_config(None, _overrides(args))
    assert (cfg.model.path, cfg.model.name, cfg.engine.max_model_len) == ("Qwen/Qwen3-0.6B", "qwen", 4096)
    assert cli_main(["serve", "--dev", "--max-model-len", "-1"]) == 2  # validated like the config key


def quantized_copy(src: Path, dst: Path, config_change: dict | None = None, side_file: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config_change:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_change)
        (dst / "config.json").write_text(json.dumps(cfg))
    if side_file:
        (dst / side_file).write_text("{}")
    return dst


@pytest.mark.parametrize("change, side_file, name", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, None, "AWQ"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, None, "GPTQ"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, None, "FP8"),
    ({"quantization_config": {"load_in_4bit": True}}, None, "bitsandbytes"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}, None, "bitsandbytes"),
    (None, "quantize_config.json", "GPTQ"),
    (None, "quant_config.json", "AWQ"),
])
def test_quantized_checkpoints_are_refused_by_name(tiny_models, tmp_path, change, side_file, name):
    d = quantized_copy(tiny_models["mistral"], tmp_path / "q", change, side_file)
    with pytest.raises(ModelLoadError, match=rf"is a {name}.*-quantized checkpoint"):
        load_model(ModelConfig(path=str(d), device="cpu"))


@pytest.mark.parametrize("tensors, name", [
    ({"model.layers.0.self_attn.q_proj.qweight": torch.zeros(4, 4, dtype=torch.int32)}, "AWQ or GPTQ"),
    ({"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}, "FP8"),
    ({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(1)}, "FP8"),
    ({"model.layers.0.mlp.down_proj.SCB": torch.ones(4)}, "bitsandbytes"),
])
def test_quantized_weights_are_refused_from_the_safetensors_header(tiny_models, tmp_path, tensors, name):
    from safetensors.torch import save_file

    d = quantized_copy(tiny_models["mistral"], tmp_path / "q")
    save_file(tensors, str(d / "model-extra.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"is a {name}.*-quantized checkpoint.*model-extra.safetensors"):
        resolve_model_dir(ModelConfig(path=str(d)))


def test_gguf_converts_to_the_serving_dtype():
    """The bundled GGUF, served in bfloat16, is stored in bfloat16 (converted once into the
    default cache, like the float32 conversion every engine test loads)."""
    cfg = ModelConfig(path=str(default_model_path()), dtype="bfloat16", device="cpu", quantization="none")
    model_dir, name = resolve_model_dir(cfg)
    assert name == "SmolLM2-135M-Instruct" and model_dir.name.endswith("-bfloat16")
    dtypes = {dt for f in model_dir.glob("*.safetensors") for _, dt in _safetensors_header(f)}
    assert dtypes == {"BF16"}
    loaded = load_model(cfg)
    assert loaded.model_dir == model_dir and loaded.dtype == torch.bfloat16
    assert loaded.model_id.endswith("/bfloat16")


def test_another_dtype_is_cast_from_the_float32_conversion(loaded_model, tmp_path, monkeypatch):
    """With the GGUF's float32 conversion in the cache, float16 is cast from it (the GGUF is not
    read again): the float32 weights cast, the config saying float16."""
    from safetensors.torch import load_file

    from mooncake.engine.loading import loader

    float32_dir = loaded_model.model_dir
    (tmp_path / "converted").mkdir()
    (tmp_path / "converted" / float32_dir.name).symlink_to(float32_dir)
    monkeypatch.setattr(loader, "_convert_gguf", lambda *a: pytest.fail("the GGUF was converted again"))
    model_dir, _ = resolve_model_dir(ModelConfig(dtype="float16", device="cpu", cache_dir=str(tmp_path)))
    assert model_dir == tmp_path / "converted" / float32_dir.name.replace("-float32", "-float16")
    theirs = load_file(next(float32_dir.glob("*.safetensors")))
    ours = load_file(next(model_dir.glob("*.safetensors")))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == torch.float16 and torch.equal(ours[k], theirs[k].half()) for k in theirs)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float16"
    assert {f.name for f in model_dir.iterdir()} == {f.name for f in float32_dir.iterdir()}
    assert load_model(ModelConfig(dtype="float16", device="cpu", cache_dir=str(tmp_path))).dtype == torch.float16


def test_gguf_only_repo_in_the_cache_is_converted_and_served_by_repo_id(loaded_model, tmp_path, monkeypatch):
    """A cached repo holding one GGUF file (the bundled one, linked as the hub links blobs)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--tiny-org--smol-gguf" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / default_model_path().name).symlink_to(default_model_path())
    model_dir, name = resolve_model_dir(ModelConfig(path="tiny-org/smol-gguf", dtype="float32"))
    assert name == "tiny-org/smol-gguf"
    assert model_dir == loaded_model.model_dir  # the same file, already converted for float32
