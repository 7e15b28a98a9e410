"""Layer-wise KV: a prefill chunk's KV leaves layer by layer, in the per-block, per-layer layout;
the forward's per-layer hooks (``LayerHooks``).

A block (``pool[i]``) is ``[layers, 2, kv_heads, block_tokens, head_dim]``: all layers' K and V of
``block_tokens`` positions. One layer of ``n`` consecutive blocks is ``[n, 2, kv_heads,
block_tokens, head_dim]`` (``pool[blocks, layer]``); it is what a ``KVLayer`` message carries.
Positions past the prompt's end in its last, partial block are zeros.

Loading a cached prefix from a store goes the other way, also layer by layer (``[engine] kv_load =
"layer"``, ``prefix_stream.py``): the store streams layers ``[lo, hi)`` of ``n`` blocks per
reply as ``[n, hi - lo, 2, kv_heads, block_tokens, head_dim]`` (``LayerSlices``); block ``i``'s slice
is the contiguous byte range of its ``[layers, ...]`` layout that holds those layers, so the block's
checksum (xxh3_64 of the whole block, as put) is verified by streaming xxh3 over its slices in order.

While the engine computes a chunk (positions ``[start, end)``), each layer's K/V are final as soon
as that layer has written them into the forward's workspace; ``ChunkLayers`` cuts, per layer, the
blocks this chunk completes out of the workspace (past positions of those blocks are there too,
gathered from the pool) and hands them to a callback on the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

LayerFn = Callable[[int, int, torch.Tensor], None]  # (layer, first block, [n, 2, Hkv, T, D])


@dataclass
class LayerHooks:
    """What one forward call does besides computing all layers over the pool (``DecoderForward.forward``).

    ``on_layer(li, ws[li])``: runs as soon as layer ``li`` has written its new K/V into the workspace
    (layer-wise KV out: ``ChunkLayers``). ``past_ready(li)``: blocks until layer ``li`` of the past KV
    is in the pool (a prefix loading layer by layer); the past is then gathered per layer, just before
    the layer attends. ``layers = (lo, hi)``: a pipeline stage runs only those layers, on ``hidden``
    (``[B*S, hidden]``, the previous stage's output) instead of the embeddings when ``lo > 0``."""

    on_layer: Callable[[int, torch.Tensor], None] | None = None
    past_ready: Callable[[int], None] | None = None
    layers: tuple[int, int] | None = None
    hidden: torch.Tensor | None = None


def completed_blocks(start: int, end: int, last: bool, block_tokens: int) -> tuple[int, int]:
    """Blocks ``[first, upto)`` whose KV is complete once positions ``[start, end)`` are computed
    (``last``: the prompt ends at ``end``, so its partial tail block is complete too)."""
    T = block_tokens
    return start // T, (-(-end // T) if last else end // T)


class ChunkLayers:
    """Per-layer hook of one prefill chunk: calls ``fn(layer, first, kv)`` with the layer's K/V of
    the blocks the chunk completes, copied out of the workspace (which the next call reuses)."""

    def __init__(self, fn: LayerFn, start: int, end: int, last: bool, block_tokens: int) -> None:
        self.fn, self.end, self.T = fn, end, block_tokens
        self.first, self.upto = completed_blocks(start, end, last, block_tokens)

    def __call__(self, layer: int, ws_layer: torch.Tensor) -> None:
        """``ws_layer``: the layer's workspace ``[2, 1, Hkv, K, D]`` after it wrote this chunk's K/V."""
        n = self.upto - self.first
        if n <= 0:
            return
        T, first = self.T, self.first
        _, _, hkv, _, d = ws_layer.shape
        out = torch.zeros((n, 2, hkv, T, d), dtype=ws_layer.dtype, device=ws_layer.device)
        dst = out.permute(1, 2, 0, 3, 4)  # [2, Hkv, n, T, D] over ``out``
        src = ws_layer[:, 0]  # [2, Hkv, K, D]
        full = min(n, self.end // T - first)
        if full > 0:
            dst[:, :, :full].copy_(src[:, :, first * T:(first + full) * T].view(2, hkv, full, T, d))
        rest = self.end - (first + full) * T
        if full < n and rest > 0:  # the prompt's partial last block
            dst[:, :, full, :rest].copy_(src[:, :, (first + full) * T:self.end])
        self.fn(layer, first, out)


def split_runs(first: int, kv: torch.Tensor, max_blocks: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first block, kv)`` pieces of at most ``max_blocks`` blocks (views, no copy), so that one
    layer of a long chunk stays within a socket's frame size limit."""
    step = max(1, max_blocks)
    for i in range(0, len(kv), step):
        yield first + i, kv[i:i + step]
