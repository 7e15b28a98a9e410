"""Qwen3: the Llama layout plus an RMSNorm over each head of q and k, before RoPE."""

from __future__ import annotations

from typing import Any

from mooncake.engine.model.families import llama
from mooncake.engine.model.families.spec import ModelSpec, RMSNorm

check = llama.check


def build(hf_model: Any) -> ModelSpec:
    spec = llama.build(hf_model)
    eps = float(hf_model.config.rms_norm_eps)
    for layer, block in zip(spec.layers, hf_model.model.layers):
        layer.q_norm = RMSNorm(block.self_attn.q_norm.weight, eps)
        layer.k_norm = RMSNorm(block.self_attn.k_norm.weight, eps)
    return spec
