"""The engine's own forward pass for the Llama family over the paged KV pool.

Llama, Mistral, Qwen2 (q/k/v bias), SmolLM: RMSNorm, RoPE, GQA, SwiGLU MLP,
tied embeddings. Weights are the loaded transformers model's own tensors (no
copy). One call computes ``S`` new tokens for each of ``B`` sequences, with
either ``B == 1`` (a prefill chunk) or ``S == 1`` (a batched decode step).

Per call, the past KV of the batch is gathered once from the pool (by block
table) into a workspace ``[L, 2, B, Hkv, K, D]``; each layer writes its new K/V
next to the past of its own sequence and attends over that row, masked to its
length. After the last layer the new K/V go to the pool in one scatter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mooncake.engine.rope import rope_tables


@dataclass
class Batch:
    """Tensors describing one forward call (built by the engine)."""

    ids: torch.Tensor  # [B*S] input token ids
    positions: torch.Tensor  # [B*S]
    B: int
    S: int
    past_table: torch.Tensor | None  # [B, Mb] pool blocks holding the past (padded), None: no past
    key_len: int  # keys attended: max over rows of past + S
    row: torch.Tensor  # [B*S] batch row of each new token (workspace write index)
    col: torch.Tensor  # [B*S] key position of each new token (workspace write index)
    slot_block: torch.Tensor  # [B*S] pool block of each new token
    slot_offset: torch.Tensor  # [B*S] offset in that block
    mask: torch.Tensor | None  # [B, 1, S, key_len] bool (True = attend) or None
    causal: bool  # B == 1, no past, S > 1: plain causal attention
    logit_rows: torch.Tensor | None  # rows of [B*S] whose logits are wanted; None: none
    col0: int = 0  # B == 1: key position of the first new token
    rows: list[tuple[int, int, list[int]]] | None = None  # decode: (seq uid, past length, past blocks)


class LlamaForward:
    def __init__(self, hf_model: Any, max_len: int, block_tokens: int) -> None:
        cfg = hf_model.config
        m = hf_model.model
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.group = self.num_heads // self.num_kv_heads
        self.eps = float(cfg.rms_norm_eps)
        self.hidden = cfg.hidden_size
        self.block_tokens = block_tokens
        p = m.embed_tokens.weight
        self.dtype, self.device = p.dtype, p.device
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.lm_head = hf_model.lm_head.weight  # tied: the same tensor as embed
        self.layers = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight,
                a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
                a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, a.o_proj.bias,
                layer.post_attention_layernorm.weight,
                mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
                mlp.down_proj.weight, mlp.down_proj.bias,
            ))
        self.cos, self.sin = rope_tables(cfg, self.head_dim, max_len, self.dtype, self.device)
        self._ws = torch.zeros(0, dtype=self.dtype, device=self.device)
        self._gather = torch.empty(0, dtype=self.dtype, device=self.device)
        # decode workspace: persists across steps; row r mirrors ``_rows[r] = (uid, valid_len)``
        self._dws = torch.zeros(0, dtype=self.dtype, device=self.device)
        self._rows: list[tuple[int, int] | None] = []

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    def _workspace(self, B: int, K: int) -> torch.Tensor:
        shape = (self.num_layers, 2, B, self.num_kv_heads, K, self.head_dim)
        n = 1
        for d in shape:
            n *= d
        if self._ws.numel() < n:  # grows only; stale contents are finite and masked
            self._ws = torch.zeros(n + n // 4, dtype=self.dtype, device=self.device)
        return self._ws[:n].view(shape)

    def _gather_past(self, pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``pool[table]`` into a reused buffer (fresh multi-GB allocations cost more than the copy)."""
        rows = table.numel()
        per = pool[0].numel()
        if self._gather.numel() < rows * per:
            self._gather = torch.empty(rows * per + rows * per // 4, dtype=self.dtype, device=self.device)
        out = self._gather[: rows * per].view(rows, per)
        torch.index_select(pool.view(pool.shape[0], per), 0, table.view(-1), out=out)
        return out.view(*table.shape, *pool.shape[1:])

    def _decode_workspace(self, pool: torch.Tensor, b: Batch) -> torch.Tensor:
        """The decode workspace ``[L, 2, B, Hkv, Kcap, D]``. A row still holding the same
        sequence's past from the previous step is reused as is (the previous step wrote its
        token there); other rows are gathered from the pool by block table."""
        assert b.rows is not None
        B, T = b.B, self.block_tokens
        ws = self._dws
        if ws.dim() != 6 or ws.shape[2] < B or ws.shape[4] < b.key_len:
            kcap = -(-max(b.key_len + 256, b.key_len * 5 // 4) // T) * T
            bcap = max(B, ws.shape[2] if ws.dim() == 6 else 0)
            ws = self._dws = torch.zeros((self.num_layers, 2, bcap, self.num_kv_heads, kcap, self.head_dim),
                                         dtype=self.dtype, device=self.device)
            self._rows = [None] * bcap
        for r, (uid, ctx, blocks) in enumerate(b.rows):
            if self._rows[r] != (uid, ctx):
                self._rows[r] = None
                if blocks:
                    table = torch.tensor(blocks, dtype=torch.long, device=self.device)[None]
                    past = self._gather_past(pool, table)[0]  # [mb, L, 2, Hkv, T, D]
                    ws[:, :, r, :, : len(blocks) * T].view(
                        self.num_layers, 2, self.num_kv_heads, len(blocks), T, self.head_dim).copy_(
                        past.permute(1, 2, 3, 0, 4, 5))
        return ws[:, :, :B]

    @torch.inference_mode()
    def forward(self, pool: torch.Tensor, b: Batch) -> torch.Tensor | None:
        """Run the layers, write the new K/V into ``pool``; logits ``[len(logit_rows), V]`` or None."""
        B, S, T = b.B, b.S, self.block_tokens
        H, Hkv, D, G = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        N = B * S
        mb = b.past_table.shape[1] if b.past_table is not None else 0
        if b.rows is not None:
            ws = self._decode_workspace(pool, b)
        else:
            ws = self._workspace(B, max(b.key_len, mb * T))
        if b.past_table is not None and b.rows is None:
            past = self._gather_past(pool, b.past_table)  # [B, Mb, L, 2, Hkv, T, D]
            ws[:, :, :, :, : mb * T].view(self.num_layers, 2, B, Hkv, mb, T, D).copy_(
                past.permute(2, 3, 0, 4, 1, 5, 6))
        cos = self.cos[b.positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin[b.positions].unsqueeze(1)
        half = D // 2
        row, col, K = b.row, b.col, b.key_len
        single = B == 1
        c0 = b.col0
        x = F.embedding(b.ids, self.embed)
        for li, (ln1, wq, bq, wk, bk, wv, bv, wo, bo, ln2, wg, bg, wu, bu, wd, bd) in enumerate(self.layers):
            h = F.rms_norm(x, (self.hidden,), ln1, self.eps)
            q = F.linear(h, wq, bq).view(N, H, D)
            k = F.linear(h, wk, bk).view(N, Hkv, D)
            v = F.linear(h, wv, bv).view(N, Hkv, D)
            q = torch.addcmul(q * cos, q.roll(half, -1), sin)
            k = torch.addcmul(k * cos, k.roll(half, -1), sin)
            kc, vc = ws[li, 0], ws[li, 1]  # [B, Hkv, K, D]
            if single:
                kc[0, :, c0:c0 + S] = k.transpose(0, 1)
                vc[0, :, c0:c0 + S] = v.transpose(0, 1)
            else:
                kc[row, :, col] = k
                vc[row, :, col] = v
            kk, vv = kc[:, :, :K], vc[:, :, :K]
            if S == 1:  # decode: the G query heads of a kv head act as G queries
                o = F.scaled_dot_product_attention(q.view(B, Hkv, G, D), kk, vv, attn_mask=b.mask)
            else:
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0), kk, vv, attn_mask=b.mask, is_causal=b.causal,
                    enable_gqa=G > 1)[0].transpose(0, 1)
            x = x + F.linear(o.reshape(N, H * D), wo, bo)
            h = F.rms_norm(x, (self.hidden,), ln2, self.eps)
            g = F.silu(F.linear(h, wg, bg))
            x = x + F.linear(g.mul_(F.linear(h, wu, bu)), wd, bd)
        # new K/V of all layers into the pool, one scatter: [N, L, 2, Hkv, D]
        pool[b.slot_block, :, :, :, b.slot_offset] = ws[:, :, row, :, col]
        if b.rows is not None:
            for r, (uid, ctx, _) in enumerate(b.rows):
                self._rows[r] = (uid, ctx + 1)
        if b.logit_rows is None:
            return None
        x = F.rms_norm(x[b.logit_rows], (self.hidden,), self.norm, self.eps)
        return F.linear(x, self.lm_head).float()
