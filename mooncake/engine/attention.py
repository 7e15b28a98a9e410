"""Attention over the decoder's KV workspace: masks (causal, per-row lengths, sliding
windows) and the attention itself (SDPA, or explicit with soft-capped scores).

Shapes: ``q [N, H, D]`` for ``N = B * S`` new tokens; ``k, v [B, Hkv, K, D]`` with key
column == token position; masks are bool, True = attend, ``[B, 1, S, K]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncake.engine.batch import Batch

Mask = tuple[torch.Tensor | None, bool]  # (mask, is_causal)


def window_mask(b: Batch, window: int) -> torch.Tensor:
    """Each query at position p sees keys in (p - window, p] (transformers' sliding window)."""
    q = b.positions.view(b.B, b.S, 1)
    k = torch.arange(b.key_len, device=q.device)
    return ((k <= q) & (k > q - window)).unsqueeze(1)


def layer_masks(b: Batch, windows: set[int | None]) -> dict[int | None, Mask]:
    """The mask of each distinct layer window for this call; a window that reaches back to
    position 0 for every query is the plain mask."""
    out: dict[int | None, Mask] = {None: (b.mask, b.causal)}
    for w in windows:
        if w is not None:
            out[w] = (window_mask(b, w), False) if b.key_len > w else out[None]
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, B: int, S: int,
           scale: float | None, softcap: float | None) -> torch.Tensor:
    """Attention output ``[N, H, D]``-shaped (contiguous in ``H * D`` per token)."""
    N, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    attn_mask, causal = mask
    if softcap is not None:
        return _softcapped(q, k, v, attn_mask, causal, B, S, scale if scale is not None else D ** -0.5, softcap)
    if S == 1:  # decode: the G query heads of a kv head act as G queries
        return F.scaled_dot_product_attention(q.view(B, Hkv, G, D), k, v, attn_mask=attn_mask, scale=scale)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=G > 1,
        scale=scale)[0].transpose(0, 1)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, causal: bool,
                B: int, S: int, scale: float, cap: float) -> torch.Tensor:
    """Gemma 2: ``softmax(tanh(q k^T * scale / cap) * cap + mask) v``, softmax in float32."""
    N, H, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    G = H // Hkv
    if S == 1:
        qq = q.view(B, Hkv, G, 1, D)
    else:  # B == 1
        qq = q.view(S, Hkv, G, D).permute(1, 2, 0, 3).unsqueeze(0)  # [1, Hkv, G, S, D]
    scores = torch.matmul(qq, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, S, K]
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is None and causal:
        attn_mask = torch.ones(S, K, dtype=torch.bool, device=q.device).tril(K - S)[None, None]
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # [B, Hkv, G, S, D]
    if S == 1:
        return out.view(B, H, D)
    return out[0].permute(2, 0, 1, 3).reshape(S, H, D)
