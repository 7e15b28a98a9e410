"""What a model family hands the shared decoder forward (``ModelSpec``): the weights, and the
few ways families differ, each named. Weights are the loaded transformers model's own tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mooncake.engine.errors import ModelLoadError
from mooncake.engine.model.rope import RopeParams

Weight = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias)


class RMSNorm:
    """RMSNorm over the last dimension. Llama style: ``w * norm(x)`` in the model dtype.
    Gemma style (``offset``): ``(1 + w) * norm(x)`` computed in float32 and cast back."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: bool = False) -> None:
        self.eps = float(eps)
        self.dim = int(weight.shape[-1])
        self.upcast = offset
        self.weight = 1.0 + weight.float() if offset else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return F.rms_norm(x.float(), (self.dim,), self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class Separate:
    """Several projections of one input, each its own weight (Llama's q/k/v, gate/up)."""

    def __init__(self, *parts: Weight) -> None:
        self.parts = parts

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(h, w, b) for w, b in self.parts)


class Fused:
    """Several projections stored as one weight (Phi-3's qkv_proj, gate_up_proj): one matmul,
    then the output split into views of ``sizes``."""

    def __init__(self, weight: Weight, sizes: list[int]) -> None:
        self.weight, self.bias = weight
        self.sizes = sizes
        if sum(sizes) != self.weight.shape[0]:
            raise ModelLoadError(f"fused projection has {self.weight.shape[0]} outputs, expected {sum(sizes)}")

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.joint(h).split(self.sizes, -1)

    def joint(self, h: torch.Tensor) -> torch.Tensor:
        """The outputs side by side, unsplit (a fresh tensor the caller may write into)."""
        return F.linear(h, self.weight, self.bias)


class Linear:
    """One projection: ``x @ weight.T + bias``."""

    def __init__(self, weight: Weight) -> None:
        self.weight, self.bias = weight

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias)


def fuse(*parts: Weight) -> Separate | Fused:
    """Projections of one input as one weight, fused at load time: one larger matmul instead
    of several small ones (at batch 1 a matmul's fixed cost dominates). The model's own
    parameters become views into the fused tensor, so no weight is held twice and the
    transformers model still runs on them. Parts with and without bias stay separate."""
    with_bias = [b is not None for _, b in parts]
    if any(with_bias) and not all(with_bias):
        return Separate(*parts)
    weight = torch.cat([w.detach() for w, _ in parts])
    bias = torch.cat([b.detach() for _, b in parts]) if all(with_bias) else None
    sizes = [int(w.shape[0]) for w, _ in parts]
    at = 0
    for (w, b), n in zip(parts, sizes):
        w.data = weight[at:at + n]
        if b is not None:
            assert bias is not None
            b.data = bias[at:at + n]
        at += n
    return Fused((weight, bias), sizes)


@dataclass
class Layer:
    attn_norm: RMSNorm
    qkv: Any  # Separate | Fused (or a quantized ``QuantizedProjection``) -> (q, k, v)
    o: Any  # Weight, made a Linear (or a quantized ``QuantizedProjection``)
    mlp_norm: RMSNorm
    gate_up: Any  # Separate | Fused (or ``QuantizedProjection``) -> (gate, up)
    down: Any  # Weight, made a Linear (or ``QuantizedProjection``)
    q_norm: RMSNorm | None = None  # per head, before RoPE (Qwen3, Gemma 3)
    k_norm: RMSNorm | None = None
    post_attn_norm: RMSNorm | None = None  # on the attention output, before the residual add (Gemma)
    post_mlp_norm: RMSNorm | None = None  # on the MLP output, before the residual add (Gemma)
    window: int | None = None  # sliding-window attention: a query at p sees keys in (p - window, p]
    rope: str = "default"  # key into ModelSpec.rope

    def __post_init__(self) -> None:
        if isinstance(self.o, tuple):
            self.o = Linear(self.o)
        if isinstance(self.down, tuple):
            self.down = Linear(self.down)


@dataclass
class ModelSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: RMSNorm
    layers: list[Layer]
    act: Callable[[torch.Tensor], torch.Tensor]  # of the gate projection (SwiGLU: silu; GeGLU: gelu)
    rope: dict[str, RopeParams] = field(default_factory=dict)
    rotary_dim: int = 0  # leading dimensions of each head that rotate; 0: all
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), in the model dtype
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores -> tanh(scores / c) * c
    logit_softcap: float | None = None  # logits -> tanh(logits / c) * c
    head: Any = None  # the lm_head as a projection (Linear, or ``QuantizedProjection``); set from lm_head

    def __post_init__(self) -> None:
        if self.head is None:
            self.head = Linear((self.lm_head, None))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str | None, where: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = ACTIVATIONS.get(name or "")
    if fn is None:
        raise ModelLoadError(f"unsupported activation {name!r} in {where}; supported: {', '.join(ACTIVATIONS)}")
    return fn


def linear(module: Any) -> Weight:
    return module.weight, module.bias


def dims(config: Any) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of a transformers config."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads, kv, int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window: ``layer_types`` says which layers slide (Gemma, Qwen);
    without it, a set ``sliding_window`` applies to every layer (Mistral, Phi-3)."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window)] * n


def rotary_dim(config: Any, head_dim: int) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim * float(factor))
