"""The decode step's own kernels (``decode_kernels.c``, built by ``native.py``): one-token
attention with its rotary and KV write, and RMSNorm with the residual add before it.

At one new token per sequence torch spends more on each op's fixed cost than on the work:
its CPU flash attention took ≈120 µs per layer at batch 1 for 512 keys and 2.4 ms at batch 32
(far below the bandwidth of reading the keys), an RMSNorm ≈45 µs as ~10 small ops. These
kernels do the same in one call each, every row (sequence) computed alone in an order fixed
by its own length: a sequence gets bitwise the same numbers in any batch, which is why the
engine uses them at every decode batch size (never for some sizes only).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from mooncake.engine.kernels.native import library

DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GROUP = 16  # query heads per kv head


class DecodeKernels:
    """Thin ctypes bindings; arguments are checked by shape and dtype (a wrong call raises
    ValueError, it never reads past a tensor)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        attn = lib.mooncake_decode_attention
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        attn.argtypes = [p, i64, i, p, p, p, p, i64, i64, p, i, i, i, i, i64, f, p, i64, p, p, p, p, p, i64, i]
        attn.restype = i
        norm = lib.mooncake_add_rmsnorm
        norm.argtypes = [p, p, p, p, i, i, f, i]
        norm.restype = i
        silu = lib.mooncake_silu_mul
        silu.argtypes = [p, p, i, i, i]
        silu.restype = i
        self._attn, self._norm, self._silu = attn, norm, silu

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                  pos: torch.Tensor, num_heads: int, window: int | None, scale: float,
                  pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  ws_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of a decode step. ``qkv [B, (H + 2 Hkv) * D]``: the fused projection's output
        (q, k, v unrotated); ``cos``, ``sin``: the rotary tables ``[max_len, D]`` (``rope.tables_of``);
        ``kv``: the layer's workspace ``[2, >=B, Hkv, Kcap, D]`` (contiguous in its last two
        dimensions), where each row's rotated k and v go at its position ``pos [B]`` (int64);
        returns the attention output ``[B, H * D]`` over keys ``[0, pos]`` (or the ``window``
        last ones). ``pool = (layer, slot_block, slot_offset)``: the new k and v also go to
        ``layer[slot_block[b], :, :, slot_offset[b]]`` (a layer of the paged pool ``[blocks, 2, Hkv, T, D]``).
        ``ws_rows [B]`` (int64; None: row b is workspace row b): each new token's workspace row, where several
        tokens of one sequence at consecutive positions (a speculative verify) share one: each attends the
        others' keys up to its own position, every row still computed alone."""
        B = qkv.shape[0]
        _, rows, Hkv, kcap, D = kv.shape
        H = num_heads
        dtype = qkv.dtype
        if (dtype not in DTYPES or cos.dtype != dtype or sin.dtype != dtype or kv.dtype != dtype
                or qkv.dim() != 2 or qkv.shape[1] != (H + 2 * Hkv) * D or qkv.stride(1) != 1
                or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != D
                or not (cos.is_contiguous() and sin.is_contiguous()) or kv.stride(4) != 1 or kv.stride(3) != D
                or (rows < B if ws_rows is None else ws_rows.dtype != torch.int64 or ws_rows.shape != (B,)
                                                     or not ws_rows.is_contiguous()) or pos.dtype != torch.int64 or pos.shape != (B,) or not pos.is_contiguous()
                or H % Hkv or H // Hkv > MAX_GROUP or D % 32 or D > MAX_HEAD_DIM):
            raise ValueError(f"decode attention cannot take qkv {dtype} {tuple(qkv.shape)}, kv {kv.dtype} "
                             f"{tuple(kv.shape)}, rotary {tuple(cos.shape)}, pos {pos.dtype} {tuple(pos.shape)}, "
                             f"{H} heads")
        pool_ptr = blocks = offsets = strides = None
        if pool is not None:
            layer, blocks, offsets = pool
            if (layer.dtype != dtype or layer.dim() != 5 or tuple(layer.shape[1:3]) != (2, Hkv) or layer.shape[4] != D
                    or layer.stride(4) != 1 or any(t.dtype != torch.int64 or t.shape != (B,) or not t.is_contiguous()
                                                   for t in (blocks, offsets))):
                raise ValueError(f"decode attention cannot write its new K/V into a pool layer {layer.dtype} "
                                 f"{tuple(layer.shape)}")
            strides = (ctypes.c_int64 * 6)(*layer.stride()[:4], layer.shape[0], layer.shape[3])
            pool_ptr = layer.data_ptr()
        out = torch.empty(B, H * D, dtype=dtype)
        if B == 0:
            return out
        limit = min(kcap, cos.shape[0])
        rc = self._attn(qkv.data_ptr(), qkv.stride(0), dtype == torch.bfloat16, cos.data_ptr(), sin.data_ptr(),
                        kv[0].data_ptr(), kv[1].data_ptr(), kv.stride(1), kv.stride(2), pos.data_ptr(), B, H, Hkv, D,
                        window or 0, scale, out.data_ptr(), limit, pool_ptr, strides,
                        blocks.data_ptr() if blocks is not None else None,
                        offsets.data_ptr() if offsets is not None else None,
                        ws_rows.data_ptr() if ws_rows is not None else None, rows, torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"decode positions must be in [0, {limit})")
        if rc == -4:
            raise ValueError("decode attention's pool slots are out of range")
        if rc == -5:
            raise ValueError(f"decode attention's workspace rows must be in [0, {rows})")
        if rc != 0:
            raise MemoryError("decode attention could not allocate its score buffer")
        return out

    def add_rmsnorm(self, x: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += a`` in place (``a`` None: no add), then ``rmsnorm(x) * weight`` (Llama style), per row of
        ``x [N, C]`` (contiguous)."""
        N, C = x.shape
        dtype = x.dtype
        if (dtype not in DTYPES or not x.is_contiguous() or weight.dtype != dtype or weight.shape != (C,)
                or not weight.is_contiguous() or C % 16
                or (a is not None and (a.dtype != dtype or a.shape != x.shape or not a.is_contiguous()))):
            raise ValueError(f"add_rmsnorm cannot take x {dtype} {tuple(x.shape)}, weight {weight.dtype} "
                             f"{tuple(weight.shape)}" + ("" if a is None else f", a {a.dtype} {tuple(a.shape)}"))
        h = torch.empty_like(x)
        if N:
            self._norm(x.data_ptr(), a.data_ptr() if a is not None else None, weight.data_ptr(), h.data_ptr(),
                       N, C, eps, dtype == torch.bfloat16)
        return h


    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up [N, 2 I]`` (the fused projection's output, contiguous)."""
        N, I2 = gate_up.shape
        if gate_up.dtype not in DTYPES or not gate_up.is_contiguous() or I2 % 32:
            raise ValueError(f"silu_mul cannot take {gate_up.dtype} {tuple(gate_up.shape)}")
        out = torch.empty(N, I2 // 2, dtype=gate_up.dtype)
        if N:
            self._silu(gate_up.data_ptr(), out.data_ptr(), N, I2 // 2, gate_up.dtype == torch.bfloat16)
        return out


def load_decode_kernels(cache_dir: Path | None = None) -> DecodeKernels | None:
    """The decode kernels, or None where they cannot run on this machine (the engine keeps torch's ops)."""
    lib = library(cache_dir)
    return DecodeKernels(lib) if lib is not None else None
