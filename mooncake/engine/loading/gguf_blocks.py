"""A GGUF file's Q8_0 weights as the file stores them, by the engine projection they make, so that
int8 serving takes the file's own values (``model/q8.py``) rather than rounding the converted
weights to int8 again.

A Q8_0 tensor ``[N, K]`` is ``N * K / 32`` blocks of 34 bytes: a float16 scale ``d``, then 32 int8
``q`` along ``K``; each value is ``d * q``. The converted Hugging Face weights are those values in
the serving dtype, with one difference for Llama-architecture files: llama.cpp's converter
permuted the rows of Q and K (for its rotary layout) and transformers' GGUF loader permutes them
back (``LlamaTensorProcessor._reverse_permute_weights``); blocks run along ``K``, so a row's
blocks move with it (``unpermute_rows``). Projections map as the engine fuses them: ``lm_head``
from ``output.weight``, else the tied ``token_embd.weight``; layer ``i``'s ``qkv`` from
``attn_q``, ``attn_k``, ``attn_v`` (or one ``attn_qkv``), ``o`` from ``attn_output``, ``gate_up``
from ``ffn_gate`` and ``ffn_up`` (or a fused ``ffn_up``), ``down`` from ``ffn_down``. A fused
projection has Q8_0 blocks only if every part is Q8_0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK = 32  # values per Q8_0 block
BLOCK_BYTES = 2 + BLOCK  # float16 d, then 32 int8 q

Q8Blocks = tuple[torch.Tensor, torch.Tensor]  # (q int8 [N, K], d float16 [N, K / 32])

_LAYER_PARTS = {  # engine projection -> the GGUF tensors (suffixes of ``blk.<i>.``) fused into it, by layout
    "qkv": (("attn_q", "attn_k", "attn_v"), ("attn_qkv",)),
    "o": (("attn_output",),),
    "gate_up": (("ffn_gate", "ffn_up"), ("ffn_up",)),
    "down": (("ffn_down",),),
}


def q8_0_tensor(data: np.ndarray, rows: int, cols: int) -> Q8Blocks:
    """(q int8 ``[rows, cols]``, d float16 ``[rows, cols / 32]``) of a Q8_0 tensor's raw bytes
    (``GGUFReader``'s ``tensor.data``, ``rows * cols / 32`` blocks of 34 bytes)."""
    if cols % BLOCK:
        raise ValueError(f"a Q8_0 row holds whole blocks of {BLOCK} values, not {cols}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(rows, cols // BLOCK, BLOCK_BYTES))  # a copy: the file is mapped read-only
    d = raw[..., :2].contiguous().view(torch.float16).reshape(rows, cols // BLOCK)
    q = raw[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
    return q, d


def unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """``rows`` (Q or K of a Llama-architecture GGUF, rows first) in the order transformers' GGUF
    loader gives them: per head, the interleaved (even, odd) row pairs split into two halves."""
    n = rows.shape[0]
    order = torch.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(1, 2).reshape(-1)
    return rows[order]


def q8_0_blocks(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Q8Blocks]:
    """The Q8_0 blocks of ``path``'s projections, keyed as ``quantize.quantize_spec`` names them
    (``lm_head``, ``layer <i> qkv``, ``layer <i> o``, ``layer <i> gate_up``, ``layer <i> down``);
    projections with any part not in Q8_0 are left out. Unreadable files give an empty dict."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except Exception as e:  # gguf raises many types; the caller then requantizes
        log.warning("cannot read Q8_0 blocks from %s (%s: %s); quantizing the converted weights instead",
                    path, type(e).__name__, e)
        return {}
    tensors = {t.name: t for t in reader.tensors}
    q8 = gguf.GGMLQuantizationType.Q8_0

    def blocks_of(names: tuple[str, ...]) -> Q8Blocks | None:
        found: list[Any] = [tensors.get(n) for n in names]
        if not all(t is not None and t.tensor_type == q8 and len(t.shape) == 2 for t in found):
            return None
        parts = []
        for name, t in zip(names, found):
            cols, rows = (int(s) for s in t.shape)  # GGUF lists the contiguous dimension first
            q, d = q8_0_tensor(t.data, rows, cols)
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(name.split(".")[-2])
            if arch == "llama" and heads is not None:
                q, d = unpermute_rows(q, heads), unpermute_rows(d, heads)
            parts.append((q, d))
        if len(parts) == 1:
            return parts[0]
        return torch.cat([q for q, _ in parts]), torch.cat([d for _, d in parts])

    out: dict[str, Q8Blocks] = {}
    head = blocks_of(("output.weight",) if "output.weight" in tensors else ("token_embd.weight",))
    if head is not None:
        out["lm_head"] = head
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()})
    for layer in layers:
        for proj, layouts in _LAYER_PARTS.items():
            for parts in layouts:
                names = tuple(f"blk.{layer}.{p}.weight" for p in parts)
                if all(n in tensors for n in names):
                    got = blocks_of(names)
                    if got is not None:
                        out[f"layer {layer} {proj}"] = got
                    break
    return out
