"""Model families on the engine's own forward: model type -> (config check, ``ModelSpec`` builder).

Each family file names only what differs from the Llama layout; the shared forward is
``mooncake.engine.model.decoder``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.model.families import gemma, llama, phi3, qwen3
from mooncake.engine.model.families.spec import ModelSpec

FAMILIES: dict[str, ModuleType] = {
    "llama": llama, "mistral": llama, "qwen2": llama, "qwen3": qwen3,
    "gemma2": gemma, "gemma3_text": gemma, "phi3": phi3,
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(model_type: str | None, where: str) -> ModuleType:
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {where}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return family


def check_config(config: Any, where: str) -> None:
    """ModelLoadError if the engine's forward cannot run this transformers config."""
    family_of(getattr(config, "model_type", None), where).check(config, where)


def model_spec(hf_model: Any) -> ModelSpec:
    """The loaded transformers model's weights and options, as the shared forward reads them."""
    config = hf_model.config
    where = str(getattr(config, "_name_or_path", "") or "model")
    family = family_of(getattr(config, "model_type", None), where)
    family.check(config, where)
    return family.build(hf_model)
