"""Phi-3: the Llama layout with q/k/v fused into one ``qkv_proj`` and gate/up into one
``gate_up_proj`` (gate first); partial rotary where the config sets it (``rotary_dim``)."""

from __future__ import annotations

from typing import Any

from mooncake.engine.model.families import llama
from mooncake.engine.model.families.spec import Fused, Layer, ModelSpec, RMSNorm, linear

check = llama.check


def layer(block: Any, eps: float, window: int | None) -> Layer:
    a, mlp = block.self_attn, block.mlp
    q = a.config.num_attention_heads * a.head_dim
    kv = (a.qkv_proj.weight.shape[0] - q) // 2
    inter = mlp.gate_up_proj.weight.shape[0] // 2
    return Layer(
        attn_norm=RMSNorm(block.input_layernorm.weight, eps),
        qkv=Fused(linear(a.qkv_proj), [q, kv, kv]),
        o=linear(a.o_proj),
        mlp_norm=RMSNorm(block.post_attention_layernorm.weight, eps),
        gate_up=Fused(linear(mlp.gate_up_proj), [inter, inter]),
        down=linear(mlp.down_proj),
        window=window)


def build(hf_model: Any) -> ModelSpec:
    return llama.build(hf_model, layer)
