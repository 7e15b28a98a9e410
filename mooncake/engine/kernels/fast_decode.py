"""A decode step's layers on the engine's own kernels (``native_decode.py``), for Llama-style
models: per layer, one call for RMSNorm with the residual add before it (twice), one for
rotary + KV write + attention, and the projections; about 8 calls instead of ~25 torch ops.

Used for every decode step of an eligible model, whatever its batch size, so a sequence's
numbers do not depend on the batch it runs in (the kernels compute each row alone). Eligibility
is an accepts-list (``MODEL_ACCEPTS``, ``LAYER_ACCEPTS``): each field of the model's spec with the
values these kernels compute; a model with a field the lists do not name, or a value they refuse
(soft-capped attention, q/k norms, partial rotary, Gemma's upcast or extra norms, unfused q/k/v),
keeps the general path of ``DecoderForward.forward``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mooncake.engine.model.families.spec import ModelSpec, RMSNorm
from mooncake.engine.kernels.native_decode import DTYPES, MAX_GROUP, MAX_HEAD_DIM, DecodeKernels, load_decode_kernels


def _plain_norm(norm: RMSNorm | None, dtype: torch.dtype) -> bool:
    return (norm is not None and not norm.upcast and norm.weight.dtype == dtype and norm.dim % 16 == 0
            and norm.weight.is_contiguous())


def _halves(gate_up: Any) -> bool:
    """Whether the gate/up projection is fused into two equal halves (``silu_mul``'s input)."""
    sizes = getattr(gate_up, "sizes", None)
    return (getattr(gate_up, "joint", None) is not None and sizes is not None and len(sizes) == 2
            and sizes[0] == sizes[1] and sizes[0] % 16 == 0)


def _any(spec: ModelSpec, value: Any) -> bool:
    return True


def _none(spec: ModelSpec, value: Any) -> bool:
    return value is None


def _plain(spec: ModelSpec, norm: RMSNorm | None) -> bool:
    return _plain_norm(norm, spec.embed.dtype)


Accepts = Callable[[ModelSpec, Any], bool]
# What the kernels compute, field by field of ``ModelSpec`` (``layers``: by ``LAYER_ACCEPTS``).
MODEL_ACCEPTS: dict[str, Accepts] = {
    "num_heads": lambda s, h: h % s.num_kv_heads == 0 and h // s.num_kv_heads <= MAX_GROUP,
    "num_kv_heads": _any,
    "head_dim": lambda s, d: d % 32 == 0 and d <= MAX_HEAD_DIM,
    "hidden": _any,
    "embed": lambda s, e: e.device.type == "cpu" and e.dtype in DTYPES,
    "lm_head": _any,  # the head runs after the layers, on the general path
    "final_norm": _plain,
    "layers": _any,
    "act": _any,  # silu fused with the multiply; others in torch
    "rope": _any,
    "rotary_dim": lambda s, r: r in (0, s.head_dim),
    "embed_scale": _none,
    "attn_scale": _any,
    "attn_softcap": _none,
    "logit_softcap": _any,  # on the logits, after the head
    "head": _any,
}
# ... and of each ``Layer``.
LAYER_ACCEPTS: dict[str, Accepts] = {
    "attn_norm": _plain,
    "qkv": lambda s, p: getattr(p, "joint", None) is not None,  # fused q/k/v
    "o": _any,
    "mlp_norm": _plain,
    "gate_up": _any,
    "down": _any,
    "q_norm": _none,
    "k_norm": _none,
    "post_attn_norm": _none,
    "post_mlp_norm": _none,
    "window": _any,
    "rope": _any,
}


def _accepted(spec: ModelSpec, obj: Any, accepts: dict[str, Accepts]) -> bool:
    """Every field of ``obj`` is listed and its value accepted (a field the list does not name: no)."""
    return all(f.name in accepts and accepts[f.name](spec, getattr(obj, f.name)) for f in fields(obj))


def eligible(spec: ModelSpec, rotary_dim: int) -> bool:
    """Whether ``FastDecode`` computes this model's decode steps exactly as the general path does:
    every field of its spec and of each layer on the accepts-lists, and the whole head rotating."""
    return (rotary_dim == spec.head_dim and _accepted(spec, spec, MODEL_ACCEPTS)
            and all(_accepted(spec, layer, LAYER_ACCEPTS) for layer in spec.layers))


class FastDecode:
    def __init__(self, spec: ModelSpec, rope: dict[Any, tuple[torch.Tensor, torch.Tensor]], kernels: DecodeKernels) -> None:
        self.spec, self.rope, self.k = spec, rope, kernels
        self.scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim ** -0.5
        self.silu = spec.act is F.silu and all(_halves(layer.gate_up) for layer in spec.layers)

    @classmethod
    def for_model(cls, spec: ModelSpec, rope: dict[Any, tuple[torch.Tensor, torch.Tensor]], rotary_dim: int,
                  native: bool) -> "FastDecode | None":
        """The fast path where the model is eligible and the kernels run here (``native``), else None."""
        if not native or not eligible(spec, rotary_dim):
            return None
        kernels = load_decode_kernels()
        return cls(spec, rope, kernels) if kernels is not None else None

    def _norm(self, x: torch.Tensor, a: torch.Tensor | None, norm: RMSNorm) -> torch.Tensor:
        return self.k.add_rmsnorm(x, a, norm.weight, norm.eps)

    def layers(self, x: torch.Tensor, ws: torch.Tensor, pos: torch.Tensor, pool: torch.Tensor,
               slot_block: torch.Tensor, slot_offset: torch.Tensor, ws_rows: torch.Tensor | None = None) -> torch.Tensor:
        """All layers for ``x [B, hidden]`` (one new token per row, at positions ``pos [B]``, int64),
        each layer's new K/V written into the decode workspace ``ws [L, 2, >=B, Hkv, Kcap, D]`` and
        into the paged ``pool`` (``[blocks, L, 2, Hkv, T, D]``, at ``slot_block``/``slot_offset``);
        ``ws_rows``: each row's workspace row when several share one (a speculative verify); returns the final-normed hidden states (``x`` holds the residual stream)."""
        spec, k = self.spec, self.k
        layers = spec.layers
        H = spec.num_heads
        h = self._norm(x, None, layers[0].attn_norm)
        for li, layer in enumerate(layers):
            cos, sin = self.rope[layer.rope]
            qkv = layer.qkv.joint(h)
            o = k.attention(qkv, cos, sin, ws[li], pos, H, layer.window, self.scale, (pool[:, li], slot_block, slot_offset),
                            ws_rows)
            h = self._norm(x, layer.o(o), layer.mlp_norm)
            if self.silu:
                m = layer.down(k.silu_mul(layer.gate_up.joint(h)))
            else:
                g, u = layer.gate_up(h)
                m = layer.down(spec.act(g).mul_(u))
            h = self._norm(x, m, layers[li + 1].attn_norm if li + 1 < len(layers) else spec.final_norm)
        return h
