"""LMDB tier: blocks on SSD, one LMDB record per block, verified on every read.

Record layout: ``b"MCK1" | u32 header length | msgpack BlockHeader | raw tensor
bytes``. The header carries dtype, shape, model identity, byte count and an
xxh3-64 checksum of the raw bytes. A record whose header or checksum does not
check out is deleted, counted in ``corrupt`` and reported as a miss.

The environment's ``map_size`` is the byte capacity plus headroom (LMDB page
overhead, free pages not yet reusable); the capacity itself is enforced here by
counting tensor bytes. ``put`` stages a block (accounted at once) and ``flush``
writes everything staged in one write transaction; the store flushes at the end
of each operation, and runs its operations off the event loop. Reads use
``buffers=True`` and make exactly one copy, from the map into a fresh tensor.
Commits are not fsync'ed (``sync=False``): data survives a process crash, not
a power loss; ``close`` syncs.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path
from typing import Iterator

import lmdb
import msgspec
import torch
import xxhash

from ..protocol import dtype_from_name, dtype_name
from .base import StoredBlock, Tier

MAGIC = b"MCK1"
_PREFIX = struct.Struct("<4sI")
MiB = 1 << 20


class BlockHeader(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    model_id: str
    nbytes: int
    checksum: int


class CorruptRecord(ValueError):
    pass


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(BlockHeader)


def encode_header(block: StoredBlock, raw: memoryview) -> bytes:
    t = block.tensor
    hdr = BlockHeader(dtype_name(t.dtype), tuple(t.shape), block.model_id, raw.nbytes, xxhash.xxh3_64_intdigest(raw))
    h = _enc.encode(hdr)
    return _PREFIX.pack(MAGIC, len(h)) + h


def parse_header(buf: memoryview) -> tuple[BlockHeader, int]:
    """(header, offset of the raw bytes); CorruptRecord when it does not check out."""
    if buf.nbytes < _PREFIX.size:
        raise CorruptRecord("short record")
    magic, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC or _PREFIX.size + hlen > buf.nbytes:
        raise CorruptRecord("bad magic or header length")
    try:
        hdr = _dec.decode(buf[_PREFIX.size:_PREFIX.size + hlen])
        dtype = dtype_from_name(hdr.dtype)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise CorruptRecord(f"bad header: {e}") from None
    off = _PREFIX.size + hlen
    n = 1
    for d in hdr.shape:
        n *= d
    if hdr.nbytes != n * torch.empty(0, dtype=dtype).element_size() or buf.nbytes - off != hdr.nbytes:
        raise CorruptRecord("size mismatch")
    return hdr, off


def _raw_view(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _record(header: bytes, raw: memoryview) -> memoryview:
    """header + raw in one buffer, built with one (torch) copy of the raw bytes."""
    buf = torch.empty(len(header) + raw.nbytes, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    mv[:len(header)] = header
    if raw.nbytes:
        buf[len(header):].copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return mv


class LmdbTier(Tier):
    name = "lmdb"
    persistent = True

    def __init__(self, path: str | Path, capacity_bytes: int, headroom: float = 0.25) -> None:
        super().__init__(capacity_bytes)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        map_size = int(capacity_bytes * (1 + headroom)) + 64 * MiB
        self.env = lmdb.open(str(self.path), map_size=map_size, subdir=True, sync=False,
                             metasync=False, readahead=False, max_dbs=0)
        self.corrupt = 0
        self._sizes: dict[bytes, int] = {}
        self._pending: dict[bytes, StoredBlock] = {}
        self._recover()

    def _recover(self) -> None:
        bad = []
        with self.env.begin(buffers=True) as txn:
            for k, v in txn.cursor():
                key = bytes(k)
                try:
                    hdr, _ = parse_header(v)
                except CorruptRecord:
                    bad.append(key)
                    continue
                self._sizes[key] = hdr.nbytes
                self.used_bytes += hdr.nbytes
        if bad:
            with self.env.begin(write=True) as txn:
                for k in bad:
                    txn.delete(k)
            self.corrupt += len(bad)

    # ---- writes

    def put(self, key: bytes, block: StoredBlock) -> bool:
        n = block.nbytes
        self.delete(key)
        if not self.fits(n):
            return False
        self._pending[key] = block
        self._sizes[key] = n
        self.used_bytes += n
        return True

    def flush(self) -> list[bytes]:
        """Write the staged blocks in one transaction; returns keys that could not be written."""
        if not self._pending:
            return []
        items, self._pending = list(self._pending.items()), {}
        try:
            with self.env.begin(write=True) as txn:
                for key, block in items:
                    raw = _raw_view(block.tensor)
                    rec = encode_header(block, raw)
                    txn.put(key, _record(rec, raw))
            return []
        except lmdb.MapFullError:
            failed = [k for k, _ in items]
            for k in failed:
                self.used_bytes -= self._sizes.pop(k, 0)
            return failed

    def delete(self, key: bytes) -> int:
        n = self._sizes.pop(key, None)
        if n is None:
            return 0
        self.used_bytes -= n
        if self._pending.pop(key, None) is None:
            with self.env.begin(write=True) as txn:
                txn.delete(key)
        return n

    # ---- reads

    def get(self, key: bytes) -> StoredBlock | None:
        staged = self._pending.get(key)
        if staged is not None:
            return staged
        if key not in self._sizes:
            return None
        with self.env.begin(buffers=True) as txn:
            v = txn.get(key)
            block = None if v is None else self._decode(v)
        if block is None:
            self.corrupt += 1
            self.delete(key)
        return block

    @staticmethod
    def _decode(v: memoryview) -> StoredBlock | None:
        try:
            hdr, off = parse_header(v)
        except CorruptRecord:
            return None
        raw = v[off:]
        if xxhash.xxh3_64_intdigest(raw) != hdr.checksum:
            return None
        dtype = dtype_from_name(hdr.dtype)
        if hdr.nbytes == 0:
            return StoredBlock(torch.empty(hdr.shape, dtype=dtype), hdr.model_id)
        out = torch.empty(hdr.nbytes, dtype=torch.uint8)
        with warnings.catch_warnings():  # read-only map buffer: we only read from it
            warnings.simplefilter("ignore", UserWarning)
            out.copy_(torch.frombuffer(raw, dtype=torch.uint8))
        return StoredBlock(out.view(dtype).view(hdr.shape), hdr.model_id)

    def contains(self, key: bytes) -> bool:
        return key in self._sizes

    def nbytes_of(self, key: bytes) -> int | None:
        return self._sizes.get(key)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._sizes))

    def __len__(self) -> int:
        return len(self._sizes)

    def close(self) -> None:
        self.flush()
        self.env.sync(True)
        self.env.close()
