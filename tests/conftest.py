"""Shared fixtures. Model fixtures are session-scoped: the model loads once per test run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def loaded_model():
    """The default LoadedModel (bundled SmolLM2-135M-Instruct, converted once and cached), in
    float32: the dtype in which the engine is token-exact against transformers."""
    from mooncake.config import ModelConfig
    from mooncake.engine import load_model

    return load_model(ModelConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def oracle_model(loaded_model):
    """The transformers model read back from the converted HF directory, float32: the oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(loaded_model.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, loaded_model):
    """family -> directory of a tiny random-weight model of that family (bundled tokenizer)."""
    from mooncake.engine.loading.tiny_models import FAMILIES, build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {f: build_tiny_model(f, root / f, loaded_model.tokenizer) for f in FAMILIES}
