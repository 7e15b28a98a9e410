"""Tiny random-weight models of every family the engine runs, for tests and benchmarks
(no download): a few layers and a small hidden size on the bundled tokenizer's vocabulary,
saved with that tokenizer as a standard Hugging Face directory.

Each config turns on what makes its family differ, at sizes a short prompt reaches:
sliding windows of a few tokens, soft-capping at values the activations hit, partial
rotary, per-layer-type rope. Weights are drawn so that logits are well separated (greedy
decisions are not coin flips between two nearly equal logits).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
              eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)

# family name -> (transformers config class name, its arguments beyond COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gemma2": ("Gemma2Config", dict(sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=2.0, hidden_activation="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=8, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", dict(sliding_window=12, partial_rotary_factor=0.5)),
}


def tiny_config(family: str, vocab_size: int) -> Any:
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(vocab_size=vocab_size, **{**COMMON, **extra})


@torch.no_grad()
def randomize(model: Any, gemma_norms: bool, seed: int = 0) -> None:
    """Well-spread random weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 0.05) (small beside the layers' outputs: a tied LM head would otherwise predict the current token again), norm
    scales near their identity (1 for ``w * x``; 0 for Gemma's ``(1 + w) * x``), small biases."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.05 if "embed" in name else 1.0 / math.sqrt(p.shape[1])
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif "norm" in name:
            centre = 0.0 if gemma_norms else 1.0
            p.copy_(centre + (torch.rand(p.shape, generator=gen) - 0.5) * 0.6)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def build_tiny_model(family: str, out: Path, tokenizer: Any, seed: int = 0, vocab_size: int = 0) -> Path:
    """Save a tiny ``family`` model with ``tokenizer`` to ``out`` (created); returns ``out``.
    ``vocab_size`` (benchmarks): a smaller vocabulary than the tokenizer's, for token-id input only."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, vocab_size or len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, gemma_norms=family.startswith("gemma"), seed=seed)
    model.config._name_or_path = f"tiny-{family}"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
