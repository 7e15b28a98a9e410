"""Gemma 2 and Gemma 3 (text): the Llama layout varied by

- embeddings scaled by sqrt(hidden) (in the model dtype), tied LM head;
- Gemma RMSNorm, ``(1 + w) * norm(x)`` in float32, also after attention and after the MLP;
- GeGLU MLP (``hidden_activation``, gelu with tanh approximation);
- attention scaled by ``query_pre_attn_scalar ** -0.5``; soft-capped scores and logits
  where configured (``attn_logit_softcapping``, ``final_logit_softcapping``);
- sliding-window and global layers alternating (``layer_types``);
- Gemma 3 only: q/k RMSNorm per head, and its own rope setting per layer type
  (local layers: theta 10k; global layers: theta 1M, possibly scaled).
"""

from __future__ import annotations

from typing import Any

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.model.families.spec import (Layer, ModelSpec, RMSNorm, activation, fuse, dims, layer_windows,
                                           linear, rotary_dim)
from mooncake.engine.model.rope import RopeParams, check_params, params_from_dict


def rope(config: Any) -> dict[str, RopeParams]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = float(getattr(config, "rope_theta", 10000.0))
    types = set(getattr(config, "layer_types", None) or ())
    if types and types <= set(params):  # one setting per layer type (Gemma 3)
        return {t: params_from_dict(params[t], theta) for t in types}
    return {"default": params_from_dict(params, theta)}


def check(config: Any, where: str) -> None:
    activation(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None), where)
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(f"bidirectional attention (an embedding model) is not supported: {where}")
    for rp in rope(config).values():
        check_params(rp)


def build(hf_model: Any) -> ModelSpec:
    cfg, m = hf_model.config, hf_model.model
    eps = float(cfg.rms_norm_eps)
    heads, kv, hd = dims(cfg)
    ropes = rope(cfg)
    types = list(getattr(cfg, "layer_types", None) or ["default"] * len(m.layers))
    layers = []
    for block, window, kind in zip(m.layers, layer_windows(cfg), types):
        a, mlp = block.self_attn, block.mlp
        layer = Layer(
            attn_norm=RMSNorm(block.input_layernorm.weight, eps, offset=True),
            qkv=fuse(linear(a.q_proj), linear(a.k_proj), linear(a.v_proj)),
            o=linear(a.o_proj),
            post_attn_norm=RMSNorm(block.post_attention_layernorm.weight, eps, offset=True),
            mlp_norm=RMSNorm(block.pre_feedforward_layernorm.weight, eps, offset=True),
            gate_up=fuse(linear(mlp.gate_proj), linear(mlp.up_proj)),
            down=linear(mlp.down_proj),
            post_mlp_norm=RMSNorm(block.post_feedforward_layernorm.weight, eps, offset=True),
            window=window,
            rope=kind if kind in ropes else "default")
        if hasattr(a, "q_norm"):
            layer.q_norm = RMSNorm(a.q_norm.weight, eps, offset=True)
            layer.k_norm = RMSNorm(a.k_norm.weight, eps, offset=True)
        layers.append(layer)
    act = activation(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None), "config")
    return ModelSpec(heads, kv, hd, int(cfg.hidden_size), m.embed_tokens.weight, hf_model.lm_head.weight,
                     RMSNorm(m.norm.weight, eps, offset=True), layers, act, rope=ropes,
                     rotary_dim=rotary_dim(cfg, hd), embed_scale=float(cfg.hidden_size) ** 0.5,
                     attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                     attn_softcap=getattr(cfg, "attn_logit_softcapping", None),
                     logit_softcap=getattr(cfg, "final_logit_softcapping", None))
