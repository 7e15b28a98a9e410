"""Tensors as ZeroMQ frames: a spec (dtype, shape) in the message, the raw bytes in a frame of
their own, rebuilt on the other side over the received buffer without a copy."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mooncake.protocol.base import ProtocolError, TensorSpec


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# dtypes a tensor frame may carry: KV pools and token ids, nothing exotic
ALLOWED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8}
MAX_DIMS = 8


def dtype_from_name(name: str) -> torch.dtype:
    dt = ALLOWED_DTYPES.get(name)
    if dt is None:
        raise ProtocolError(f"dtype {name!r} is not allowed on the wire")
    return dt


def tensor_frame(t: torch.Tensor) -> tuple[TensorSpec, memoryview]:
    """A contiguous CPU tensor as (spec, zero-copy buffer). The caller keeps ``t`` alive
    until ZeroMQ has sent it (``copy=False``)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return TensorSpec(dtype_name(t.dtype), tuple(t.shape)), memoryview(raw.numpy())


def frame_tensor(buf: Any, spec: TensorSpec) -> torch.Tensor:
    """A tensor over a received buffer (zmq.Frame, bytes or memoryview), without a copy."""
    dtype = dtype_from_name(spec.dtype)
    if len(spec.shape) > MAX_DIMS or any(d < 0 for d in spec.shape):
        raise ProtocolError(f"invalid tensor shape {spec.shape}")
    mv = memoryview(buf.buffer if hasattr(buf, "buffer") else buf)
    n = 1
    for d in spec.shape:
        n *= d
    expected = n * torch.empty(0, dtype=dtype).element_size()
    if mv.nbytes != expected:
        raise ProtocolError(f"tensor frame has {mv.nbytes} bytes, spec {spec} needs {expected}")
    if expected == 0:
        return torch.empty(spec.shape, dtype=dtype)
    with warnings.catch_warnings():  # received buffers are read-only; we never write to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=dtype).view(spec.shape)
