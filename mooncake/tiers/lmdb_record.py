"""The LMDB tier's record: ``b"MCK1" | u32 header length | msgpack BlockHeader | raw tensor bytes``.

The header carries dtype, shape, model identity, byte count, an xxh3-64
checksum of the raw bytes, and the checksum the block's writer sent with it (the
end-to-end one readers verify; 0 in records written before it was kept);
``parse_header`` raises ``CorruptRecord`` when a record does not check out.
"""

from __future__ import annotations

import struct
import warnings

import msgspec
import torch
import xxhash

from ..protocol import dtype_from_name, dtype_name
from .base import StoredBlock

MAGIC = b"MCK1"
_PREFIX = struct.Struct("<4sI")


class BlockHeader(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    model_id: str
    nbytes: int
    checksum: int
    sent_checksum: int = 0


class CorruptRecord(ValueError):
    pass


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(BlockHeader)


def encode_header(block: StoredBlock, raw: memoryview) -> bytes:
    t = block.tensor
    hdr = BlockHeader(dtype_name(t.dtype), tuple(t.shape), block.model_id, raw.nbytes, xxhash.xxh3_64_intdigest(raw),
                      block.checksum)
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


def encode_record(block: StoredBlock) -> memoryview:
    """The whole record of ``block``, ready for ``txn.put``."""
    raw = _raw_view(block.tensor)
    return _record(encode_header(block, raw), raw)


def decode_record(v: memoryview) -> StoredBlock | None:
    """The block of a record (one copy out of ``v``), or None when it does not check out."""
    try:
        hdr, off = parse_header(v)
    except CorruptRecord:
        return None
    raw = v[off:]
    if xxhash.xxh3_64_intdigest(raw) != hdr.checksum:
        return None
    dtype = dtype_from_name(hdr.dtype)
    if hdr.nbytes == 0:
        return StoredBlock(torch.empty(hdr.shape, dtype=dtype), hdr.model_id, hdr.sent_checksum)
    out = torch.empty(hdr.nbytes, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only map buffer: we only read from it
        warnings.simplefilter("ignore", UserWarning)
        out.copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return StoredBlock(out.view(dtype).view(hdr.shape), hdr.model_id, hdr.sent_checksum)
