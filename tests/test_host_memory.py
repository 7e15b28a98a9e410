"""glibc's malloc set to keep freed memory: a freed multi-MB activation is reused by the next
one instead of being returned to the OS and faulted in again page by page."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

import pytest
import torch

from mooncake.engine.host_memory import keep_freed_memory


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_freed_activations_are_reused_without_page_faults():
    assert keep_freed_memory()
    assert keep_freed_memory()  # idempotent
    block = 8 << 20  # 2,048 pages of 4 KiB: above glibc's default mmap threshold
    for _ in range(2):  # the first ones may fault their pages in
        torch.empty(block, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(block, dtype=torch.uint8).fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 4 * block // 4096, faults  # without reuse: 14,000 to 40,000 here


def test_elsewhere_nothing_changes(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False
