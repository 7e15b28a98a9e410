"""Llama, Mistral, Qwen2, SmolLM: RMSNorm, RoPE, GQA, SwiGLU MLP, optional q/k/v bias,
sliding window where the config sets one (Mistral). The base the other families vary."""

from __future__ import annotations

from typing import Any, Callable

from mooncake.engine.model.families.spec import (Layer, ModelSpec, RMSNorm, activation, fuse, dims, layer_windows,
                                           linear, rotary_dim)
from mooncake.engine.model.rope import RopeParams, check_params, params_from_dict


def rope(config: Any) -> dict[str, RopeParams]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return {"default": params_from_dict(params, float(getattr(config, "rope_theta", 10000.0)))}


def check(config: Any, where: str) -> None:
    activation(getattr(config, "hidden_act", "silu"), where)
    for rp in rope(config).values():
        check_params(rp)


def layer(block: Any, eps: float, window: int | None) -> Layer:
    a, mlp = block.self_attn, block.mlp
    return Layer(
        attn_norm=RMSNorm(block.input_layernorm.weight, eps),
        qkv=fuse(linear(a.q_proj), linear(a.k_proj), linear(a.v_proj)),
        o=linear(a.o_proj),
        mlp_norm=RMSNorm(block.post_attention_layernorm.weight, eps),
        gate_up=fuse(linear(mlp.gate_proj), linear(mlp.up_proj)),
        down=linear(mlp.down_proj),
        window=window)


def build(hf_model: Any, make_layer: Callable[[Any, float, int | None], Layer] = layer) -> ModelSpec:
    cfg, m = hf_model.config, hf_model.model
    eps = float(cfg.rms_norm_eps)
    heads, kv, hd = dims(cfg)
    layers = [make_layer(b, eps, w) for b, w in zip(m.layers, layer_windows(cfg))]
    return ModelSpec(heads, kv, hd, int(cfg.hidden_size), m.embed_tokens.weight, hf_model.lm_head.weight,
                     RMSNorm(m.norm.weight, eps), layers, activation(getattr(cfg, "hidden_act", "silu"), "config"),
                     rope=rope(cfg), rotary_dim=rotary_dim(cfg, hd))
