"""Shared-memory segments for the same-node fast path of the store API.

A client on the same machine as its store keeps a few segments (files in
``/dev/shm``, mapped by both processes). For a put it copies block bytes into
a segment and sends only offsets; the server copies them into its tier. For a
get the server copies blocks into the client's segment and replies with
offsets; the client copies them out. Two memcpys, no socket transfer, no
kernel buffer copies. Segment names are random and checked by the server.

Every copy into or out of a segment of CPU tensors is a plain single-threaded memcpy (numpy, the
GIL released), never a torch op: torch parallelizes a copy of a few hundred KB over its OpenMP
team, and with the cores busy (an engine beside the store, other processes) each region waited
on a wake-up; puts of 368,640-byte blocks ran at 0.3-0.6 GB/s, half of ZeroMQ's, that way. A
batch whose blocks lie back to back in one tensor (a ``[n, ...]`` KV export) is one memcpy.
Segments are mapped with ``MAP_POPULATE`` once and reused, so no put or get faults fresh pages
in.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from urllib.parse import urlparse

import numpy as np
import torch

from ..protocol import ShmRef, TensorSpec, dtype_from_name

SHM_DIR = "/dev/shm"
ALIGN = 64
SEGMENT_BYTES = 16 << 20  # the smallest segment; a larger one is the power of two a request needs
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


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 array (no copy; any dtype, bfloat16 too)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _one_span(blocks: list[torch.Tensor]) -> np.ndarray | None:
    """The bytes of ``blocks`` as one array when they lie back to back in one CPU storage, each a
    multiple of ``ALIGN`` bytes long (so their aligned layout in a segment is the same); else None."""
    first = blocks[0]
    if first.device.type != "cpu" or not first.is_contiguous() or first.nbytes % ALIGN:
        return None
    storage, ptr = first.untyped_storage(), first.data_ptr()
    for b in blocks:
        if (b.device.type != "cpu" or not b.is_contiguous() or b.nbytes != first.nbytes
                or b.untyped_storage().data_ptr() != storage.data_ptr() or b.data_ptr() != ptr):
            return None
        ptr += b.nbytes
    start = first.data_ptr() - storage.data_ptr()
    span = torch.empty(0, dtype=torch.uint8).set_(storage, start, (first.nbytes * len(blocks),))
    return span.numpy()


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
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault every page in now
            self._mm = mmap.mmap(fd, self.size, flags=flags) if self.size else None
        finally:
            os.close(fd)
        self.arr = np.frombuffer(self._mm, dtype=np.uint8) if self._mm is not None else np.empty(0, np.uint8)
        self.buf = torch.from_numpy(self.arr)
        if create and not hasattr(mmap, "MAP_POPULATE"):
            self.arr[::mmap.PAGESIZE] = 0  # fault the pages in once, not on every first use

    def write(self, offset: int, t: torch.Tensor) -> TensorSpec:
        """Copy ``t`` (any device) to ``offset``; returns its spec."""
        n = t.numel() * t.element_size()
        if offset < 0 or offset + n > self.size:
            raise ValueError("tensor does not fit in the segment")
        if n and t.device.type == "cpu":
            self.arr[offset:offset + n] = _bytes_of(t.contiguous())
        elif n:  # a device tensor: one transfer straight into the segment
            self.buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        return _spec(t)

    def write_blocks(self, blocks: list[torch.Tensor]) -> list[ShmRef]:
        """Copy ``blocks`` to the segment from offset 0, each at an aligned offset (one memcpy when
        they lie back to back in one tensor); their references. ValueError if they do not fit."""
        sizes = [aligned(b.numel() * b.element_size()) for b in blocks]
        if sum(sizes) > self.size:
            raise ValueError("blocks do not fit in the segment")
        span = _one_span(blocks) if blocks else None
        if span is not None:
            self.arr[:span.size] = span
            return [ShmRef(i * sizes[0], _spec(b)) for i, b in enumerate(blocks)]
        refs, off = [], 0
        for b, n in zip(blocks, sizes):
            refs.append(ShmRef(off, self.write(off, b)))
            off += n
        return refs

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

    def read(self, offset: int, spec: TensorSpec) -> torch.Tensor:
        """A fresh copy of the tensor at ``offset`` (a single-threaded memcpy)."""
        src = self.view(offset, spec)
        out = torch.empty(spec.shape, dtype=src.dtype)
        if out.numel():
            _bytes_of(out)[:] = self.arr[offset:offset + out.nbytes]
        return out

    def close(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.arr = np.empty(0, np.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the map goes with it
                pass
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass


class SegmentPool:
    """Client side: its segments, reused; at most ``max_segments`` and ``max_bytes`` in all."""

    def __init__(self, max_bytes: int, max_segments: int) -> None:
        self.max_bytes, self.max_segments = max_bytes, max_segments
        self.free: list[ShmSegment] = []
        self.all: list[ShmSegment] = []

    def take(self, nbytes: int) -> ShmSegment | None:
        """The smallest free segment of at least ``nbytes``, else a new one within the limits (in
        place of a free one too small when at ``max_segments``); None: use the socket (all busy,
        so concurrent requests do not fault in fresh memory, or over ``max_bytes``)."""
        fits = [s for s in self.free if s.size >= nbytes]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self.free.remove(seg)
            return seg
        size = 1 << (max(nbytes, SEGMENT_BYTES) - 1).bit_length()
        if len(self.all) >= self.max_segments:
            if not self.free:
                return None
            small = self.free.pop(0)
            self.all.remove(small)
            small.close()
        if sum(s.size for s in self.all) + size > self.max_bytes:
            return None
        seg = ShmSegment(size=size, create=True)
        self.all.append(seg)
        return seg

    def give(self, seg: ShmSegment) -> None:
        """Return a segment taken (its request is done)."""
        if seg in self.all:
            self.free.append(seg)

    def drop(self, seg: ShmSegment) -> None:
        """Close a segment taken and never hand it out again."""
        if seg in self.all:
            self.all.remove(seg)
            seg.close()

    def close(self) -> None:
        for seg in self.all:
            seg.close()
        self.all.clear()
        self.free.clear()


class SegmentCache:
    """Server side: segments attached by name, the least recently used closed beyond ``limit``
    (attaching maps and faults in every page: the limit is kept above what the clients of a node
    hold, ``StoreClient.shm_max_segments`` each, so a busy node does not re-attach)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._segs: OrderedDict[str, ShmSegment] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._segs)

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
