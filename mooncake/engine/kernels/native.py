"""The engine's own C kernels for decode, built at install time (else on first use): the int8
and int4 matrix-vector products for small batches (``quant_gemv.c``, here) and the decode step's
attention and RMSNorm (``decode_kernels.c``, called through ``native_decode.py``).

At one to a few rows torch's ``aten._weight_int8pack_mm`` reads the weights at about 10 GB/s
on this 2-core AVX-512 VM, against 30+ GB/s for a plain reduction over the same bytes: a
decode step at batch 1 is mostly those reads. ``quant_gemv.c`` reads each weight row once for
all rows of the batch, prefetching ahead of its reads (what lifted it from 10 to 21-32 GB/s on
the lm_head), with integer dot products on exact-enough int16 parts of the activations (int8;
int4 unpacks each group of weights to float32 once for up to 4 rows and sums in float32; with
``[engine] int4_activations = "int8"`` int4 instead rounds the activations to int8 per block
of 32 and multiplies them with the nibbles by AVX-512 VNNI ``vpdpbusd``, ``int4_vnni.c``):
float32-accurate ``x @ (w8 * scale).T`` (int4: per group of 32, ``x @ (q * scale + zero).T``; a
GGUF file's Q8_0 weights, int8 with a scale per group of 32, ``Q8Gemv``), the
float reference's arithmetic, and each row
independent of the others (a sequence computes the same in any batch of fewer than 8). It is
compiled by ``mooncake/native_build.py`` (``KERNELS``: sources, flags and the CPU features
they need) and called through ctypes on tensors' memory. Where it cannot run (no C compiler,
no AVX-512, another OS) ``load_kernel`` returns None, the engine keeps torch's kernel, and
one warning per process says why.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from mooncake import native_build

MAX_K = 8192  # quant_gemv.c's MAX_K (int8): longer rows would overflow its int32 lanes


class Int8Gemv:
    """``out = (x @ w8.T) * scale`` for ``x [M, K]`` bfloat16 or float32 (contiguous), ``w8 [N, K]``
    int8, ``scale [N]`` float32; ``out [M, N]`` in ``x``'s dtype."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.mooncake_int8_gemv
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        M, K = x.shape
        N = w8.shape[0]
        if (x.dtype not in (torch.bfloat16, torch.float32) or w8.dtype != torch.int8 or scale.dtype != torch.float32
                or w8.shape[1] != K or scale.shape != (N,) or x.device.type != "cpu"
                or not (x.is_contiguous() and w8.is_contiguous() and scale.is_contiguous())):
            raise ValueError(f"int8 kernel takes contiguous CPU x [M, K] bfloat16/float32, w8 [N, K] int8, scale [N] "
                             f"float32; got {x.dtype} {tuple(x.shape)}, {w8.dtype} {tuple(w8.shape)}, "
                             f"{scale.dtype} {tuple(scale.shape)}")
        out = torch.empty(M, N, dtype=x.dtype)
        rc = self._fn(x.data_ptr(), x.dtype == torch.bfloat16, w8.data_ptr(), scale.data_ptr(), out.data_ptr(),
                      M, N, K, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"int8 kernel cannot compute [{M}, {K}] x [{N}, {K}] (K must be a multiple of 32, at most 8192)")
        return out


class Int4Gemv:
    """``out = x @ W.T`` with ``W[n, k] = q[n, k] * scale[n, g] + zero[n, g]`` over groups ``g``
    of 32 along ``k``: ``x [M, K]`` bfloat16 or float32 (contiguous), ``w4 [N, K / 2]`` uint8 (a
    group's 16 bytes: its elements 0-15 in the low nibbles, 16-31 in the high ones), ``scale`` and
    ``zero [N, K / 32]`` float32; ``out [M, N]`` in ``x``'s dtype. ``activations``: ``"float"``
    (``quant_gemv.c``: float32 sums, the float reference to float32 accuracy) or ``"int8"``
    (``int4_vnni.c``: x rounded to int8 per block of 32, integer dot products; relative error
    of an output about 1e-3 of the weights' and x's magnitudes, see ``ERROR_BOUND``)."""

    GROUP = 32
    ACTIVATIONS = ("int8", "float")
    ERROR_BOUND = 0.01  # int8: worst-case ||out - ref|| / ||ref|| over tests/test_int4_vnni.py's matrices

    def __init__(self, lib: ctypes.CDLL, activations: str = "float") -> None:
        if activations not in self.ACTIVATIONS:
            raise ValueError(f"int4 activations are int8 or float, not {activations!r}")
        self.activations = activations
        fn = lib.mooncake_int4_gemv_q8 if activations == "int8" else lib.mooncake_int4_gemv
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, x: torch.Tensor, w4: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        M, K = x.shape if x.dim() == 2 else (0, 0)
        N = w4.shape[0] if w4.dim() == 2 else 0
        groups = (N, K // self.GROUP)
        if (M < 1 or N < 1 or x.dtype not in (torch.bfloat16, torch.float32) or w4.dtype != torch.uint8 or K % self.GROUP
                or w4.shape[1] * 2 != K or scale.dtype != torch.float32 or zero.dtype != torch.float32
                or scale.shape != groups or zero.shape != groups or x.device.type != "cpu"
                or not all(t.is_contiguous() for t in (x, w4, scale, zero))):
            raise ValueError(f"int4 kernel takes contiguous CPU x [M, K] bfloat16/float32 (K a multiple of 32), "
                             f"w4 [N, K/2] uint8, scale and zero [N, K/32] float32; got {x.dtype} {tuple(x.shape)}, "
                             f"{w4.dtype} {tuple(w4.shape)}, {scale.dtype} {tuple(scale.shape)}, "
                             f"{zero.dtype} {tuple(zero.shape)}")
        out = torch.empty(M, N, dtype=x.dtype)
        rc = self._fn(x.data_ptr(), x.dtype == torch.bfloat16, w4.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                      out.data_ptr(), M, N, K, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"int4 kernel cannot compute [{M}, {K}] x [{N}, {K}]")
        return out


class Q8Gemv:
    """``out[m, n] = sum_g scale[n, g] * sum_{k in g} w8[n, k] * x[m, k]`` over groups ``g`` of 32
    along ``k`` (GGUF's Q8_0): ``x [M, K]`` bfloat16 or float32 (contiguous), ``w8 [N, K]`` int8,
    ``scale [N, K / 32]`` float16 (the file's own); ``out [M, N]`` in ``x``'s dtype. Float32 sums (each group's
    products, then times its scale), each row of ``x`` through the same operations whatever ``M``."""

    GROUP = 32

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.mooncake_q8_0_gemv
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        M, K = x.shape if x.dim() == 2 else (0, 0)
        N = w8.shape[0] if w8.dim() == 2 else 0
        if (M < 1 or N < 1 or x.dtype not in (torch.bfloat16, torch.float32) or w8.dtype != torch.int8
                or K % self.GROUP or w8.shape[1] != K or scale.dtype != torch.float16
                or scale.shape != (N, K // self.GROUP) or x.device.type != "cpu"
                or not all(t.is_contiguous() for t in (x, w8, scale))):
            raise ValueError(f"Q8_0 kernel takes contiguous CPU x [M, K] bfloat16/float32 (K a multiple of 32), "
                             f"w8 [N, K] int8, scale [N, K/32] float16; got {x.dtype} {tuple(x.shape)}, "
                             f"{w8.dtype} {tuple(w8.shape)}, {scale.dtype} {tuple(scale.shape)}")
        out = torch.empty(M, N, dtype=x.dtype)
        rc = self._fn(x.data_ptr(), x.dtype == torch.bfloat16, w8.data_ptr(), scale.data_ptr(), out.data_ptr(),
                      M, N, K, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"Q8_0 kernel cannot compute [{M}, {K}] x [{N}, {K}]")
        return out


@functools.lru_cache(maxsize=None)
def library(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The kernels' library (built if missing, loaded once per process), or None where it cannot
    run (with a warning saying why)."""
    return native_build.load(native_build.KERNELS, cache_dir)


def load_kernel(cache_dir: Path | None = None) -> Int8Gemv | None:
    """The int8 kernel, or None where it cannot run on this machine."""
    lib = library(cache_dir)
    return Int8Gemv(lib) if lib is not None else None


def load_int4_kernel(cache_dir: Path | None = None, activations: str = "float") -> Int4Gemv | None:
    """The int4 kernel (``activations``: see ``Int4Gemv``), or None where it cannot run on this machine."""
    lib = library(cache_dir)
    return Int4Gemv(lib, activations) if lib is not None else None


def load_q8_kernel(cache_dir: Path | None = None) -> Q8Gemv | None:
    """The Q8_0 kernel, or None where it cannot run on this machine."""
    lib = library(cache_dir)
    return Q8Gemv(lib) if lib is not None else None
