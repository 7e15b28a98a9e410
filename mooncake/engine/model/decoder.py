"""The engine's own forward pass over the paged KV pool, shared by every model family.

A family (``mooncake.engine.model.families``) hands over a ``ModelSpec``: the loaded
transformers model's own tensors (no copy) and the few ways it differs from Llama
(norm style, fused projections, q/k norms, GeGLU, embedding scale, attention scale and
soft-capping, sliding windows per layer, rope per layer type). One call computes ``S``
new tokens for each of ``B`` sequences, with either ``B == 1`` (a prefill chunk, or the
chunks of several sequences packed side by side in one row: ``Batch.packed``) or
``S == 1`` (a batched decode step).

Per call, the past KV of the batch is gathered once from the pool (by block
table) into a workspace ``[L, 2, B, Hkv, K, D]``; each layer writes its new K/V
next to the past of its own sequence and attends over that row, masked to its
length (and to its window on sliding-window layers: every block is kept, so blocks
stay shareable). After the last layer the new K/V go to the pool in one scatter; a
prefill chunk may also hand each layer's K/V out as soon as the layer wrote them, or wait for
each layer's past to load (``LayerHooks``, see ``mooncake/kv/layers.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from mooncake.engine.model.attention import attend, layer_masks
from mooncake.engine.batch import Batch
from mooncake.engine.model.families import model_spec
from mooncake.engine.kernels.fast_decode import FastDecode
from mooncake.engine.model.int8 import QuantizedProjection
from mooncake.engine.model.quantize import quantize_spec
from mooncake.engine.model.rope import tables_of

if TYPE_CHECKING:
    from mooncake.kv.layers import LayerHooks


class DecoderForward:
    def __init__(self, hf_model: Any, max_len: int, block_tokens: int, quantization: str = "none",
                 native: bool = True, int4_activations: str = "float", gguf: Path | None = None) -> None:
        """``native``: the engine's own kernels where they run (``native.py``: int8 or int4 at small batch;
        ``fast_decode.py``: every decode step of a Llama-style model); else torch's. ``int4_activations``:
        the int4 kernel's (``[engine] int4_activations``); ``gguf``: the file the model was converted from
        (its Q8_0 weights quantized as stored)."""
        self.spec = spec = model_spec(hf_model)
        if quantization in ("int8", "int4"):
            quantize_spec(spec, native, quantization, int4_activations, gguf)
        self.num_layers = len(spec.layers)
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.rotary_dim = spec.rotary_dim or spec.head_dim
        self.block_tokens = block_tokens
        self.embed = spec.embed
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.embed_scale = (torch.tensor(spec.embed_scale, dtype=self.dtype, device=self.device)
                            if spec.embed_scale is not None else None)
        self.windows = {layer.window for layer in spec.layers}
        self.rope = {key: tables_of(rp, self.rotary_dim, max_len, self.dtype, self.device)
                     for key, rp in spec.rope.items()}
        self.fast = FastDecode.for_model(spec, self.rope, self.rotary_dim, native)
        self._ws = torch.zeros(0, dtype=self.dtype, device=self.device)
        self._gather = torch.empty(0, dtype=self.dtype, device=self.device)
        # decode workspace: persists across steps; row r mirrors ``_rows[r] = (uid, valid_len)``
        self._dws = torch.zeros(0, dtype=self.dtype, device=self.device)
        self._rows: list[tuple[int, int] | None] = []
        # rows filled ahead of a sequence's first step as its KV lands (``stage``):
        # row -> ((uid, ctx), blocks in per layer)
        self._staged: dict[int, tuple[tuple[int, int], list[int]]] = {}
        self.row_gathers = 0  # decode rows gathered from the pool (a staged row is not)
        self.workspace_grows = 0  # decode workspace reallocations

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

    def _gather_past(self, pool: torch.Tensor, table: torch.Tensor,
                     layers: tuple[int, int] | None = None) -> torch.Tensor:
        """``pool[table]`` (only ``layers``, for a pipeline stage) into a reused buffer (fresh
        multi-GB allocations cost more than the copy)."""
        src = pool if layers is None else pool[:, layers[0]:layers[1]]
        rows = table.numel()
        per = src[0].numel()
        if self._gather.numel() < rows * per:
            self._gather = torch.empty(rows * per + rows * per // 4, dtype=self.dtype, device=self.device)
        out = self._gather[: rows * per]
        if layers is None:
            torch.index_select(pool.view(pool.shape[0], per), 0, table.view(-1), out=out.view(rows, per))
        else:
            torch.index_select(src, 0, table.view(-1), out=out.view(rows, *src.shape[1:]))
        return out.view(*table.shape, *src.shape[1:])

    def _gather_layer(self, pool: torch.Tensor, table: torch.Tensor, li: int, wl: torch.Tensor) -> None:
        """Layer ``li`` of the past blocks ``table`` ``[B, Mb]`` into its workspace ``wl`` ``[2, B, Hkv, K, D]``."""
        B, mb = table.shape
        T, Hkv, D = self.block_tokens, self.num_kv_heads, self.head_dim
        past = pool[:, li].index_select(0, table.view(-1)).view(B, mb, 2, Hkv, T, D)
        wl[:, :, :, : mb * T].view(2, B, Hkv, mb, T, D).copy_(past.permute(2, 0, 3, 1, 4, 5))

    def _decode_workspace(self, pool: torch.Tensor, b: Batch) -> torch.Tensor:
        """The decode workspace ``[L, 2, B, Hkv, Kcap, D]``. A row still holding the same
        sequence's past from the previous step is reused as is (the previous step wrote its
        token there); other rows are gathered from the pool by block table."""
        assert b.rows is not None
        B, T = b.B, self.block_tokens
        ws = self._grown(B, b.key_len)
        for r, (uid, ctx, blocks) in enumerate(b.rows):
            if self._rows[r] != (uid, ctx):
                self._rows[r] = None
                staged = self._staged.pop(r, None)
                if staged is not None and staged[0] == (uid, ctx) and min(staged[1]) >= len(blocks):
                    continue  # its KV was copied in as it landed
                self.row_gathers += 1
                if blocks:
                    table = torch.tensor(blocks, dtype=torch.long, device=self.device)[None]
                    past = self._gather_past(pool, table)[0]  # [mb, L, 2, Hkv, T, D]
                    ws[:, :, r, :, : len(blocks) * T].view(
                        self.num_layers, 2, self.num_kv_heads, len(blocks), T, self.head_dim).copy_(
                        past.permute(1, 2, 3, 0, 4, 5))
        return ws[:, :, :B]

    def _grown(self, rows: int, key_len: int) -> torch.Tensor:
        """The decode workspace, reallocated if it has fewer than ``rows`` rows or ``key_len`` positions.
        Rows grow to the next power of two (a batch growing one sequence at a time reallocates
        log2(B) times, not B times) and what the rows held comes along: a sequence decoding while the
        batch grows is not gathered again, and what was staged stays staged. A reallocation of a
        workspace of B rows of K positions is a step's worth of copying (BENCHMARKS.md section 11)."""
        ws, T = self._dws, self.block_tokens
        if ws.dim() != 6 or ws.shape[2] < rows or ws.shape[4] < key_len:
            old_b, old_k = (ws.shape[2], ws.shape[4]) if ws.dim() == 6 else (0, 0)
            kcap = max(-(-max(key_len + 256, key_len * 5 // 4) // T) * T, old_k)
            bcap = max(1 << (rows - 1).bit_length(), old_b)
            grown = torch.zeros((self.num_layers, 2, bcap, self.num_kv_heads, kcap, self.head_dim),
                                dtype=self.dtype, device=self.device)
            if old_b:
                grown[:, :, :old_b, :, :old_k].copy_(ws)
            ws = self._dws = grown
            self._rows += [None] * (bcap - old_b)
            self.workspace_grows += 1
        return ws

    @torch.inference_mode()
    def stage(self, row: int, uid: int, ctx: int, first_block: int, kv: torch.Tensor, layer: int | None) -> None:
        """Copy KV landing for a sequence that will decode (``uid``, prompt of ``ctx`` tokens) into decode
        workspace row ``row`` too, so that its first step need not gather its whole past from the pool:
        ``kv`` is one layer ``[n, 2, Hkv, T, D]`` (``layer``) or whole blocks ``[n, L, 2, Hkv, T, D]`` of
        blocks ``[first_block, first_block + n)``. The first step takes the row as it is only if it is that
        sequence's row then and every layer of every block came in this way; otherwise it gathers, as
        always. The caller names a row no other sequence of the next step takes before this one (decode:
        the number of sequences running, below ``max_batch``). A workspace too small grows when the
        sequence's first blocks land (so the first step need not grow it either)."""
        T, L, Hkv, D = self.block_tokens, self.num_layers, self.num_kv_heads, self.head_dim
        n = len(kv)
        key_len = max((first_block + n) * T, ctx + 1)
        if first_block == 0:
            self._grown(row + 1, -(-key_len // T) * T)
        ws = self._dws
        if ws.dim() != 6 or row >= ws.shape[2] or ws.shape[4] < key_len:
            return
        staged = self._staged.get(row)
        if staged is None or staged[0] != (uid, ctx):
            staged = self._staged[row] = ((uid, ctx), [0] * L)
        self._rows[row] = None
        dst = ws[:, :, row, :, first_block * T:(first_block + n) * T]  # [L, 2, Hkv, n*T, D]
        if layer is None:
            dst.view(L, 2, Hkv, n, T, D).copy_(kv.permute(1, 2, 3, 0, 4, 5))
        else:
            dst[layer].view(2, Hkv, n, T, D).copy_(kv.permute(1, 2, 0, 3, 4))
        for li in range(L) if layer is None else (layer,):
            if staged[1][li] >= first_block:  # contiguous from block 0
                staged[1][li] = max(staged[1][li], first_block + n)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        if rd == self.head_dim:
            return torch.addcmul(x * cos, x.roll(rd // 2, -1), sin)
        r = x[..., :rd]  # partial rotary: the leading dimensions rotate, the rest pass
        return torch.cat([torch.addcmul(r * cos, r.roll(rd // 2, -1), sin), x[..., rd:]], -1)

    def _qkv(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's rotated queries ``[N, H, D]`` and keys and values ``[N, 2, Hkv, D]``
        (keys rotated). With a fused projection and no q/k norm, q and k rotate together in
        place in the projection's output, where k and v already lie side by side: three ops
        and no copy instead of six ops and a stack."""
        N, H, Hkv, D = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        joint = getattr(layer.qkv, "joint", None)
        if joint is not None and layer.q_norm is None and self.rotary_dim == D:
            out = joint(h).view(N, H + 2 * Hkv, D)
            qk = out[:, :H + Hkv]
            torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin, out=qk)
            return out[:, :H], out[:, H:].view(N, 2, Hkv, D)
        q, k, v = layer.qkv(h)
        q, k, v = q.view(N, H, D), k.view(N, Hkv, D), v.view(N, Hkv, D)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        return self._rotate(q, cos, sin), torch.stack((self._rotate(k, cos, sin), v), 1)

    @torch.inference_mode()
    def forward(self, pool: torch.Tensor, b: Batch, hooks: LayerHooks | None = None) -> torch.Tensor | None:
        """Run the layers, write the new K/V into ``pool``; logits ``[len(logit_rows), V]`` or None.
        ``hooks`` (``LayerHooks``): per-layer KV out, a past loading layer by layer, a pipeline stage's
        layers (which writes only their K/V, and returns its hidden states instead of logits when its
        last layer is not the model's)."""
        on_layer = hooks.on_layer if hooks is not None else None
        past_ready = hooks.past_ready if hooks is not None else None
        layers = hooks.layers if hooks is not None else None
        hidden = hooks.hidden if hooks is not None else None
        spec = self.spec
        lo_layer, hi_layer = layers if layers is not None else (0, self.num_layers)
        B, S, T = b.B, b.S, self.block_tokens
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        N = B * S
        mb = b.past_table.shape[1] if b.past_table is not None else 0
        if b.rows is not None:
            ws = self._decode_workspace(pool, b)
            if self.fast is not None and layers is None and on_layer is None and hidden is None:
                x = self.fast.layers(F.embedding(b.ids, self.embed), ws, b.col, pool, b.slot_block, b.slot_offset,
                                     b.ws_rows)
                self._rows_advanced(b)  # the kernels wrote the new K/V into the pool too
                return self._logits(x)  # x: final-normed
            if b.ws_rows is not None:
                raise ValueError("a speculative verify runs on the engine's decode kernels only")
        else:
            ws = self._workspace(B, max(b.key_len, mb * T))
        per_layer = past_ready is not None and b.rows is None
        if b.past_table is not None and b.rows is None and not per_layer:
            past = self._gather_past(pool, b.past_table, layers)  # [B, Mb, layers, 2, Hkv, T, D]
            ws[lo_layer:hi_layer, :, :, :, : mb * T].view(hi_layer - lo_layer, 2, B, Hkv, mb, T, D).copy_(
                past.permute(2, 3, 0, 4, 1, 5, 6))
        rope = {key: (cos[b.positions].unsqueeze(1), sin[b.positions].unsqueeze(1))  # [N, 1, rd]
                for key, (cos, sin) in self.rope.items()}
        masks = layer_masks(b, self.windows, spec.attn_softcap is not None, self.dtype)
        row, col, K = b.row, b.col, b.key_len
        single = B == 1 and not b.packed
        c0 = b.col0
        if lo_layer > 0:
            assert hidden is not None, "a stage past the first runs on the previous stage's hidden states"
            x = hidden.to(self.device, self.dtype)
        else:
            x = F.embedding(b.ids, self.embed)
            if self.embed_scale is not None:
                x = x * self.embed_scale
        act, scale, softcap = spec.act, spec.attn_scale, spec.attn_softcap
        for li in range(lo_layer, hi_layer):
            layer = spec.layers[li]
            h = layer.attn_norm(x)
            q, kv = self._qkv(layer, h, *rope[layer.rope])
            wl = ws[li]  # [2, B, Hkv, K, D]
            if per_layer:
                assert past_ready is not None
                past_ready(li)
                if b.past_table is not None:
                    self._gather_layer(pool, b.past_table, li, wl)
            if single:
                wl[:, 0, :, c0:c0 + S] = kv.permute(1, 2, 0, 3)
            else:
                wl[:, row, :, col] = kv
            kc, vc = wl[0], wl[1]  # [B, Hkv, K, D]
            if on_layer is not None:
                on_layer(li, ws[li])
            mask = masks[layer.window]
            lo = mask[2]
            o = attend(q, kc[:, :, lo:K], vc[:, :, lo:K], mask, B, S, scale, softcap)
            a = layer.o(o.reshape(N, H * D))
            x.add_(layer.post_attn_norm(a) if layer.post_attn_norm is not None else a)
            h = layer.mlp_norm(x)
            g, u = layer.gate_up(h)
            m = layer.down(act(g).mul_(u))
            x.add_(layer.post_mlp_norm(m) if layer.post_mlp_norm is not None else m)
        self._store_new_kv(pool, b, ws, lo_layer, hi_layer)
        if hi_layer < self.num_layers:
            return x
        if b.logit_rows is None:
            return None
        return self._logits(spec.final_norm(x[b.logit_rows]))

    def _store_new_kv(self, pool: torch.Tensor, b: Batch, ws: torch.Tensor, lo: int, hi: int) -> None:
        """The new K/V of layers ``[lo, hi)`` into the pool, one scatter (``[N, layers, 2, Hkv, D]``); decode
        rows now hold their sequence's past one token longer."""
        if lo == 0 and hi == self.num_layers:
            pool[b.slot_block, :, :, :, b.slot_offset] = ws[:, :, b.row, :, b.col]
        else:
            pool[b.slot_block, lo:hi, :, :, b.slot_offset] = ws[lo:hi, :, b.row, :, b.col]
        self._rows_advanced(b)

    def _rows_advanced(self, b: Batch) -> None:
        if b.rows is not None:
            for r, (uid, ctx, _) in enumerate(b.rows):
                self._rows[r] = (uid, ctx + (b.row_tokens[r] if b.row_tokens is not None else 1))

    def rows_kept(self, kept: dict[int, int]) -> None:
        """After a speculative verify: the workspace row of sequence ``uid`` holds its past up to
        ``kept[uid]`` positions (the rejected drafts' keys past that are stale, masked by length)."""
        for r, held in enumerate(self._rows):
            if held is not None and held[0] in kept:
                self._rows[r] = (held[0], min(held[1], kept[held[0]]))

    @property
    def verify_rows(self) -> int:
        """The most new tokens one forward may compute while each gets bitwise what a one-token
        decode step of its sequence gets (0: speculative decoding cannot keep that here): the decode
        kernels compute each token alone, and every projection must too -- the engine's quantized
        kernels below their ``max_rows`` (torch's matmuls change a row's result with the row count)."""
        if self.fast is None:
            return 0
        spec = self.spec
        projections = [spec.head] + [p for layer in spec.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if not all(isinstance(p, QuantizedProjection) and p.kernel is not None for p in projections):
            return 0
        return min(p.max_rows for p in projections) - 1

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits of final-normed hidden states."""
        spec = self.spec
        logits = spec.head(normed).float()
        if spec.logit_softcap is not None:
            logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
        return logits
