"""Shared-memory segments for the same-node fast path of the store API.

A client on the same machine as its store keeps a few segments (files in
``/dev/shm``, mapped by both processes). For a put it copies block bytes into
a segment and sends only offsets; the server copies them into its tier. For a
get the server copies blocks into the client's segment and replies with
offsets; the client copies them out. Two memcpys, no socket transfer, no
kernel buffer copies. Segment names are random and checked by the server.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from urllib.parse import urlparse

import torch

from ..protocol import TensorSpec, dtype_from_name

SHM_DIR = "/dev/shm"
ALIGN = 64
_NAME = re.compile(r"^mooncake-[0-9a-f]{32}$")


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def is_local_endpoint(endpoint: str) -> bool:
    """ipc:// or a loopback tcp:// address: the server runs on this machine."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = urlparse(endpoint).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShmSegment:
    """A mapped segment. ``create=True`` makes (and pre-faults) a new one; else attach by name."""

    def __init__(self, name: str | None = None, size: int = 0, create: bool = False) -> None:
        if create:
            name = name or f"mooncake-{secrets.token_hex(16)}"
        if not name or not _NAME.match(name):
            raise ValueError(f"bad shared-memory segment name {name!r}")
        self.name = name
        self.owner = create
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)
        if create:
            self.buf.zero_()  # fault the pages in once, not on every first use

    def write(self, offset: int, t: torch.Tensor) -> TensorSpec:
        """Copy ``t`` (any device) to ``offset``; returns its spec."""
        n = t.numel() * t.element_size()
        if offset + n > self.size:
            raise ValueError("tensor does not fit in the segment")
        if n:
            dst = self.buf[offset:offset + n].view(t.dtype).view(t.shape)
            dst.copy_(t)
        return TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape))

    def view(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """A tensor over the segment's bytes (no copy); valid while the segment is open."""
        dtype = dtype_from_name(spec.dtype)
        n = 1
        for d in spec.shape:
            n *= d
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError("tensor reference outside the segment")
        return self.buf[offset:offset + nbytes].view(dtype).view(spec.shape)

    def close(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the map goes with it
            pass
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass


class SegmentCache:
    """Server side: segments attached by name, the least recently used closed beyond ``limit``."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._segs: OrderedDict[str, ShmSegment] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> ShmSegment:
        with self._lock:
            seg = self._segs.get(name)
            if seg is not None:
                self._segs.move_to_end(name)
                return seg
            for old in [n for n in self._segs if not os.path.exists(os.path.join(SHM_DIR, n))]:
                self._segs.pop(old).close()  # its client closed it
            seg = ShmSegment(name)
            self._segs[name] = seg
            while len(self._segs) > self.limit:
                self._segs.popitem(last=False)[1].close()
            return seg

    def close(self) -> None:
        with self._lock:
            for seg in self._segs.values():
                seg.close()
            self._segs.clear()
