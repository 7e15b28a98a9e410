"""Host allocator settings for CPU inference.

glibc's malloc serves blocks above its mmap threshold with fresh ``mmap`` pages and gives
freed memory at the top of its heap back to the OS (trim), so each forward pays page
faults again for its multi-MB activations. Measured here (2 threads, bf16): an RMSNorm over
512 rows of 576 took 1.4 ms with those faults and 0.14 ms without. ``keep_freed_memory``
raises the thresholds so freed blocks stay in the process and are reused: the resident
size stays at its peak instead of shrinking between forwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest accepted value on 64-bit; larger blocks stay mmap'ed
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse; False where the C library is not
    glibc (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
