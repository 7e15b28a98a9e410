"""The KV index's flat block -> holders table in C (``fingerprint_table.c``), for the walk the
scheduler does once per request: each holder's leading run of a chain and how far the stores
cover it.

Why C: with a million blocks indexed, a decision's walk as Python set probes costs two cache
misses per block and holder (the set's slot, then the key object it compares) — p99 82 µs of
the decision's first-timed 108 µs in ``bench_scheduler.py``'s index, against 13 µs when the same
chain is walked again. The table keeps one 8-byte fingerprint and a holder bit mask per block
in one slot, probes once per block for all holders, and prefetches ahead along the chain.

A fingerprint is a block hash's first 8 bytes. Chained block hashes are uniformly random, so
two blocks of one index share a fingerprint with probability ~n²/2⁶⁵ (≈3·10⁻⁸ at a million
blocks); were it to happen, the walk would report a run one node does not have, which costs
what any stale index entry costs (the worker reads what it holds and computes the rest).
Where the library cannot be had (``native_build.py``: installed with the package, else built
on first use; not without a C compiler) ``FingerprintTable.create`` returns None and the index
walks its Python sets.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from typing import Sequence

from mooncake import native_build

FP_BYTES = 8

_void, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(native_build.FINGERPRINT_TABLE)
    if lib is None:
        return None
    lib.mooncake_fp_new.argtypes, lib.mooncake_fp_new.restype = [_int], _void
    lib.mooncake_fp_free.argtypes, lib.mooncake_fp_free.restype = [_void], None
    lib.mooncake_fp_len.argtypes, lib.mooncake_fp_len.restype = [_void], ctypes.c_uint64
    lib.mooncake_fp_widen.argtypes, lib.mooncake_fp_widen.restype = [_void, _int], _int
    for name in ("mooncake_fp_add", "mooncake_fp_remove"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [_void, _int, ctypes.c_char_p, _i64, _i64], _int
    lib.mooncake_fp_clear_bit.argtypes, lib.mooncake_fp_clear_bit.restype = [_void, _int], _int
    lib.mooncake_fp_walk.argtypes = [_void, ctypes.c_char_p, _i64, _i64, ctypes.c_char_p, _void, _void]
    lib.mooncake_fp_walk.restype = _int
    return lib


def _packed(hashes: Sequence[bytes]) -> tuple[bytes, int]:
    """The hashes as one buffer and the stride of their fingerprints in it."""
    data = b"".join(hashes)
    n = len(hashes)
    stride = len(hashes[0]) if n else FP_BYTES
    if stride >= FP_BYTES and len(data) == n * stride:  # equal lengths (a chain from hash_blocks)
        return data, stride
    return b"".join(h[:FP_BYTES].ljust(FP_BYTES, b"\0") for h in hashes), FP_BYTES


class FingerprintTable:
    """Block hash -> the bits of the nodes that hold it (bit numbers are the caller's)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._words = 1
        self._t = lib.mooncake_fp_new(self._words)
        if not self._t:
            raise MemoryError("fingerprint table")
        self._outputs(self._words)

    @classmethod
    def create(cls) -> FingerprintTable | None:
        lib = _library()
        return cls(lib) if lib is not None else None

    def __del__(self) -> None:
        if getattr(self, "_t", None):
            self._lib.mooncake_fp_free(self._t)
            self._t = None

    def __len__(self) -> int:
        return self._lib.mooncake_fp_len(self._t)

    def _outputs(self, words: int) -> None:
        self._pairs = array("q", bytes(8 * 2 * 64 * words))  # (bit, run) pairs: sliced faster than a ctypes array
        self._store_end = ctypes.c_int64()
        self._out_ptrs = (self._pairs.buffer_info()[0], ctypes.addressof(self._store_end))

    def _fits(self, bit: int) -> None:
        words = bit // 64 + 1
        if words > self._words:
            if self._lib.mooncake_fp_widen(self._t, words) != 0:
                raise MemoryError("fingerprint table")
            self._words = words
            self._outputs(words)

    def add(self, bit: int, hashes: Sequence[bytes]) -> None:
        self._fits(bit)
        data, stride = _packed(hashes)
        if self._lib.mooncake_fp_add(self._t, bit, data, stride, len(hashes)) != 0:
            raise MemoryError("fingerprint table")

    def remove(self, bit: int, hashes: Sequence[bytes]) -> None:
        if bit < 64 * self._words:
            data, stride = _packed(hashes)
            self._lib.mooncake_fp_remove(self._t, bit, data, stride, len(hashes))

    def clear_bit(self, bit: int) -> None:
        if bit < 64 * self._words and self._lib.mooncake_fp_clear_bit(self._t, bit) != 0:
            raise MemoryError("fingerprint table")

    def walk(self, hashes: Sequence[bytes], store_mask: int) -> tuple[array, int]:
        """``[bit, leading run, bit, leading run, ...]`` for the holders of block 0, and the
        first block that no holder in ``store_mask`` holds."""
        if not hashes:
            return array("q"), 0
        data, stride = _packed(hashes)
        found = self._lib.mooncake_fp_walk(self._t, data, stride, len(hashes),
                                           store_mask.to_bytes(8 * self._words, "little"), *self._out_ptrs)
        return self._pairs[:2 * found], self._store_end.value
