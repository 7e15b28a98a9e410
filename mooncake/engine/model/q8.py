"""GGUF's Q8_0 weights served as the file stores them: int8 values with a float16 scale per group
of 32 along a row (``loading/gguf_blocks.py`` reads them), where ``Int8Projection`` would round the
converted weights again to int8 with one scale per row (losing the file's own values). The
scales cost 1/16 byte per weight more than int8 rows: at batch 1, bound by reading the weights, the
bundled model's head is 5-10% slower than it was as int8 rows (a decode step 1-5%), with 4 rows
per call 10% faster (BENCHMARKS.md section 2).

As with int8 and int4 (``int8.py``, ``int4.py``), the model's float weights are overwritten by
the dequantized values (``q * d`` in the serving dtype: for a weight converted from that file,
the values it already holds), the float reference; calls with few rows read the int8 weights and
the float16 scales (1/16 byte per weight more than int8 rows) with the engine's kernel
(``native.Q8Gemv``: per group the products summed in float32, then times the group's scale; each
row of the batch through the same operations whatever the row count, as speculative decoding
needs), others use the dequantized weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mooncake.engine.kernels.native import Q8Gemv, load_q8_kernel
from mooncake.engine.model.int8 import INT8_MAX_ROWS, QuantizedProjection

GROUP = Q8Gemv.GROUP


def dequantize_q8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of int8 ``w8 [N, K]`` and float16 ``scale [N, K / 32]``: each value
    ``q * d``, exact in float32 (an 8-bit integer times a float16)."""
    N, K = w8.shape
    return (w8.float().reshape(N, K // GROUP, GROUP) * scale.float()[..., None]).reshape(N, K)


def holds_q8(weight: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, chunk_rows: int = 4096) -> bool:
    """Whether ``weight`` is exactly ``dequantize_q8(w8, scale)`` rounded to its dtype (a weight
    converted from the file those blocks came from), ``chunk_rows`` at a time."""
    N, K = weight.shape
    if w8.shape != (N, K) or scale.shape != (N, K // GROUP) or K % GROUP:
        return False
    return all(torch.equal(weight[r:r + chunk_rows], dequantize_q8(w8[r:r + chunk_rows], scale[r:r + chunk_rows])
                           .to(weight.dtype)) for r in range(0, N, chunk_rows))


class Q8Projection(QuantizedProjection):
    max_rows = INT8_MAX_ROWS
    load_kernel = staticmethod(load_q8_kernel)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None,
                 kernel: Q8Gemv | None, blocks: tuple[torch.Tensor, torch.Tensor]) -> None:
        """``blocks``: (int8 ``[N, K]``, float16 scale ``[N, K / 32]``), the file's Q8_0 values in
        the weight's row order (``gguf_blocks.q8_0_blocks``)."""
        w8, scale = blocks
        self.w8, self.scale = w8.contiguous(), scale.to(torch.float16).contiguous()
        with torch.no_grad():  # the float reference: the dequantized weight, in place
            for r in range(0, weight.shape[0], 4096):
                weight[r:r + 4096].copy_(dequantize_q8(self.w8[r:r + 4096], self.scale[r:r + 4096]))
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.kernel = kernel

    def small(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(flat.contiguous(), self.w8, self.scale)
        return F.linear(flat, self.weight)
