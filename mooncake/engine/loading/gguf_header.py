"""Whether a GGUF file stores its weights quantized, read from its header alone.

``general.file_type`` (llama.cpp's ``LLAMA_FTYPE``) says how the file's weight tensors are
stored: 0 all float32, 1 mostly float16, 32 mostly bfloat16, anything else a quantized format
(Q8_0, Q4_1, Q4_K_M, ...). It sits among the first metadata entries; reading up to it takes
milliseconds, where ``gguf.GGUFReader`` parses every tensor's record (seconds for a small model).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

FLOAT_FILE_TYPES = (0, 1, 32)  # all F32, mostly F16, mostly BF16
Q4_0 = 2  # all Q4_0: groups of 32 with a scale each, symmetric (the engine's int4 groups with zero = -8 * scale)
Q4_1 = 3  # all Q4_1: groups of 32 with a scale and an offset each, as the engine's int4 weights
Q8_0 = 7  # mostly Q8_0: int8 with a float16 scale per group of 32 (served as stored: ``model/q8.py``)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read(fh: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize("<" + fmt)
    data = fh.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack("<" + fmt, data)[0]


def _string(fh: BinaryIO) -> bytes:
    n = int(_read(fh, "Q"))
    data = fh.read(n)
    if len(data) != n:
        raise ValueError("truncated GGUF header")
    return data


def _skip(fh: BinaryIO, value_type: int) -> None:
    if value_type == _STRING:
        fh.seek(int(_read(fh, "Q")), 1)
    elif value_type == _ARRAY:
        item_type, count = int(_read(fh, "I")), int(_read(fh, "Q"))
        if item_type in _SCALAR:
            fh.seek(count * struct.calcsize("<" + _SCALAR[item_type]), 1)
        else:
            for _ in range(count):
                _skip(fh, item_type)
    elif value_type in _SCALAR:
        fh.seek(struct.calcsize("<" + _SCALAR[value_type]), 1)
    else:
        raise ValueError(f"unknown GGUF value type {value_type}")


def gguf_file_type(path: Path) -> int | None:
    """The file's ``general.file_type``, or None when it has none or is not a GGUF (version 2 or 3)."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF" or _read(fh, "I") not in (2, 3):
                return None
            _read(fh, "Q")  # tensor count
            for _ in range(int(_read(fh, "Q"))):
                key, value_type = _string(fh), int(_read(fh, "I"))
                if key == b"general.file_type" and value_type in _SCALAR:
                    return int(_read(fh, _SCALAR[value_type]))
                _skip(fh, value_type)
    except (OSError, ValueError, struct.error):
        return None
    return None


def gguf_is_quantized(path: Path) -> bool:
    """Whether ``path`` is a GGUF whose weights are stored in a quantized format."""
    file_type = gguf_file_type(path)
    return file_type is not None and file_type not in FLOAT_FILE_TYPES
