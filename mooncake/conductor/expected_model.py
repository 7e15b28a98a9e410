"""What the conductor expects its engines to serve, from its own copy of the model.

The conductor has the model directory (for the tokenizer); from it, without loading
weights, it knows the weights' identity (``<name>@<fingerprint16>``, the prefix of
the engines' ``model_id``) and the shape of one KV block. A registering engine must
match them: the first registrant no longer decides what the cluster serves. The dtype
(the ``model_id``'s last part) is pinned too when ``[model] dtype`` names one, and so is the
weights' quantization when ``[model] quantization`` does; with ``auto`` either depends on each
engine's device, and the first engine fixes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake import protocol as P
from mooncake.config import Config


@dataclass(frozen=True)
class ExpectedModel:
    weights_id: str  # "<name>@<fingerprint16>"
    dtype: str | None  # None: any (``[model] dtype = "auto"``)
    block_tokens: int
    block_shape: tuple[int, ...]  # [layers, 2, kv_heads, block_tokens, head_dim]
    variant: str = ""  # after the dtype: quantization, KV codec and block hash scheme (loader.model_variant)
    any_quantization: bool = False  # ``[model] quantization = "auto"``: ``variant`` names none, the engine's may

    def problem(self, facts: P.ModelFacts) -> str | None:
        """Why ``facts`` (from a registering engine) are not this model, or None."""
        weights_id, _, dtype = facts.model_id.rpartition("/")
        if weights_id != self.weights_id:
            return f"it serves weights {weights_id!r}, the conductor's model is {self.weights_id!r}"
        bare = dtype.removesuffix(self.variant) if self.variant else dtype
        if self.any_quantization:  # at most one scheme's suffix
            bare = next((bare.removesuffix(q) for q in ("-int8+q8_0", "-int4+q8_0", "-int8", "-int4")
                         if bare.endswith(q)), bare)
        if not dtype.endswith(self.variant) or "-" in bare or "+" in bare:
            return f"it serves {dtype!r}, the cluster {(self.dtype or '<dtype>') + self.variant!r} (quantization, KV codec, block hash)"
        dtype = bare
        if self.dtype is not None and dtype != self.dtype:
            return f"it computes in {dtype}, the cluster in {self.dtype}"
        if facts.block_tokens != self.block_tokens or tuple(facts.block_shape) != self.block_shape:
            return (f"its KV blocks are {list(facts.block_shape)} ({facts.block_tokens} tokens), the cluster's "
                    f"{list(self.block_shape)} ({self.block_tokens} tokens)")
        return None


def expected_model(cfg: Config) -> ExpectedModel:
    """The model the conductor's config names (no weights loaded; ModelLoadError if unusable)."""
    from transformers import AutoConfig

    from mooncake.engine.loading.loader import model_variant, resolve_model_dir, weights_id

    model_dir, name = resolve_model_dir(cfg.model)
    hf = AutoConfig.from_pretrained(model_dir)
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    T = cfg.engine.block_tokens
    dtype = None if cfg.model.dtype == "auto" else cfg.model.dtype
    return ExpectedModel(weights_id(model_dir, name, cfg.model.cache_dir), dtype, T,
                         (int(hf.num_hidden_layers), 2, int(kv_heads), T, int(head_dim)), model_variant(cfg.model),
                         cfg.model.quantization == "auto")
