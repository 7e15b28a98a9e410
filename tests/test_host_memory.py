"""glibc's malloc set to keep freed memory: a freed multi-MB activation is reused by the next
one instead of being returned to the OS and faulted in again page by page."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from mooncake.engine.host_memory import keep_freed_memory


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


# Each measurement runs in a fresh process: page faults are counted per process, and in the
# test session's own process other threads (and a heap shaped by earlier tests) fault pages too.
# 64 MiB of 64 KiB pieces (heap memory, as activations below the mmap threshold) is filled and
# freed, five times: glibc's defaults give the freed top of the heap back to the OS each time,
# so every round faults its 16,384 pages in again.
ROUNDS, PIECES, PIECE = 5, 1024, 64 << 10
MEASURE = f"""
import ctypes, ctypes.util, resource, sys
from mooncake.engine.host_memory import keep_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
def fill_and_free():
    pieces = [libc.malloc({PIECE}) for _ in range({PIECES})]
    for p in pieces:
        ctypes.memset(p, 1, {PIECE})
    for p in reversed(pieces):
        libc.free(p)
fill_and_free()  # the first round faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS}):
    fill_and_free()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", MEASURE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_freed_memory_is_kept_and_reused_without_page_faults():
    pages = ROUNDS * PIECES * PIECE // 4096
    assert _faults("default") > pages // 2  # given back and faulted in again (~all of them here)
    assert _faults("keep") < pages // 100  # kept by the process: reused as it is


def test_elsewhere_nothing_changes(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False
