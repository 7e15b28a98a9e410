"""Attention over the decoder's KV workspace: masks (causal, per-row lengths, sliding
windows) and the attention itself (SDPA, or explicit with soft-capped scores).

Shapes: ``q [N, H, D]`` for ``N = B * S`` new tokens; ``k, v [B, Hkv, K, D]`` with key
column == token position; masks are bool, True = attend, ``[B, 1, S, K]``, or for the
explicit (soft-capped) attention additive float biases of the same shape, 0 or -inf,
built once per call and shared by the layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncake.engine.batch import Batch

Mask = tuple[torch.Tensor | None, bool, int]  # (mask over keys [lo, K), is_causal, lo)


def window_mask(b: Batch, window: int, lo: int = 0) -> torch.Tensor:
    """Each query at position p sees keys in (p - window, p] (transformers' sliding window);
    the mask covers keys ``[lo, key_len)``."""
    q = b.positions.view(b.B, b.S, 1)
    k = torch.arange(lo, b.key_len, device=q.device)
    return ((k <= q) & (k > q - window)).unsqueeze(1)


def layer_masks(b: Batch, windows: set[int | None], additive: bool = False,
                dtype: torch.dtype = torch.float32) -> dict[int | None, Mask]:
    """The mask of each distinct layer window for this call; a window that reaches back to
    position 0 for every query is the plain mask. A window's keys start at ``lo``, the first
    key any query of the call sees: a decode step attends over about ``window`` keys, not
    the whole context. ``additive``: as float biases (no ``is_causal`` shortcut), for
    ``attend`` with ``softcap``."""
    out: dict[int | None, Mask] = {None: (b.mask, b.causal, 0)}
    first = b.col0 if b.rows is None else min(ctx for _, ctx, _ in b.rows)  # lowest query position
    for w in windows:
        if w is not None and b.key_len > w:
            lo = max(0, first - w + 1)
            single_decode = b.B == 1 and b.S == 1  # its keys [lo, K) are exactly its window
            out[w] = (None if single_decode else window_mask(b, w, lo), False, lo)
        elif w is not None:
            out[w] = out[None]
    if additive:
        for w, (mask, causal, lo) in out.items():
            if mask is None and causal:
                mask = torch.ones(b.S, b.key_len, dtype=torch.bool, device=b.ids.device).tril(b.key_len - b.S)
                mask = mask[None, None]
            bias = None
            if mask is not None:
                bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            out[w] = (bias, False, lo)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, B: int, S: int,
           scale: float | None, softcap: float | None) -> torch.Tensor:
    """Attention output ``[N, H, D]``-shaped (contiguous in ``H * D`` per token); ``k, v``
    are the keys ``[lo, K)`` of ``mask``."""
    N, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    attn_mask, causal, _ = mask
    if softcap is not None:
        return _softcapped(q, k, v, attn_mask, causal, B, S, scale if scale is not None else D ** -0.5, softcap)
    if S == 1:  # decode: the G query heads of a kv head act as G queries
        return F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, attn_mask=attn_mask, scale=scale)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=G > 1,
        scale=scale)[0].transpose(0, 1)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
                B: int, S: int, scale: float, cap: float) -> torch.Tensor:
    """Gemma 2: ``softmax(tanh(q k^T * scale / cap) * cap + bias) v``, softmax in float32;
    ``bias`` additive (``layer_masks(additive=True)``)."""
    N, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    if S == 1:
        qq = q.view(B, Hkv, G, 1, D)
    else:  # B == 1
        qq = q.view(S, Hkv, G, D).permute(1, 2, 0, 3).unsqueeze(0)  # [1, Hkv, G, S, D]
    assert not causal, "soft-capped attention takes explicit additive masks"
    scores = torch.matmul(qq, k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, G, S, K]
    scores.mul_(scale).div_(cap).tanh_().mul_(cap)
    if bias is not None:
        scores.add_(bias.unsqueeze(2))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # [B, Hkv, G, S, D]
    if S == 1:
        return out.view(B, H, D)
    return out[0].permute(2, 0, 1, 3).reshape(S, H, D)
