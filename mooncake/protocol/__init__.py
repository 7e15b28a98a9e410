"""Wire protocol: msgspec structs (a tagged union) in MessagePack, tensors as frames.

A message on the wire is a ZeroMQ multipart message::

    [msgpack(Message), payload_0, payload_1, ...]

Messages that carry tensors describe them in a ``tensors: list[TensorSpec]``
field, one spec per payload frame, in order. Payload frames are the raw bytes
of contiguous CPU tensors, sent with ``copy=False``; receivers rebuild tensors
over the received buffers without a copy (``decode``). No Python-object serialization
ever travels on the wire: only MessagePack and raw tensor bytes.

The store's object API addresses blocks by ``BlockHash``; one block is one
payload frame in the engine's per-block layout ``[layers, 2, kv_heads,
block_tokens, head_dim]`` (see ``mooncake.engine``). Layer-wise KV (``KVLayer``) carries one
layer of ``n`` blocks in one frame: ``[n, 2, kv_heads, block_tokens, head_dim]``. A store's
``GetLayers`` stream carries layers ``[lo, hi)`` of ``n`` blocks in one frame per reply
(``LayerSlices``): ``[n, hi - lo, 2, kv_heads, block_tokens, head_dim]``. A pipeline
stage's ``Activations`` carry a chunk's hidden states in one frame ``[tokens, hidden]``.

Importing the package does not import torch (the ``mooncake p2p`` command starts without it):
the tensor half (``tensors.py``: ``frame_tensor``, ``tensor_frame``, the dtypes) loads when a
message carries tensors or one of its names is first read.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

import msgspec

from mooncake.protocol.base import Msg, ProtocolError, TensorSpec
from mooncake.protocol.frontend import (Admitted, AttemptEnded, Claim, Claims, ClusterQuery, ClusterView, Ended, Prefilled,
                                        Refused, Release, Route, Submit, WorkerRef)
from mooncake.protocol.membership import (ENGINE_ROLES, Heartbeat, Leave, Load, ModelFacts, NodeInfo, Register, Registered,
                                          Reregister, TierLoad, node_of, process_instance,
                                          routing_id)
from mooncake.protocol.p2p import P2PMessage
from mooncake.protocol.requests import (Abort, Activations, DecodeRequest, Failed, FailureKind, FetchPlan, FinishReason, FirstToken,
                                        FrontendGone, orders_identity,
                                        KVLayer, KVTransfer, Logprob, PrefillDone, PrefillRequest, Reserved, Sampling,
                                        StageDone, StagePlan, TokenEvent, TokenStep)
from mooncake.protocol.store import (BlockEvent, Blocks, Error, Exists, Get, GetLayers, Keep, LayerSlices, Ok, Put,
                                     Remove, Replicate, ShmBlocks, ShmGet, ShmPut, ShmRef, StatsQuery)

if TYPE_CHECKING:
    import torch

__all__ = [
    "Admitted",
    "AttemptEnded",
    "Claim",
    "Claims",
    "ClusterQuery",
    "ClusterView",
    "Ended",
    "Prefilled",
    "Refused",
    "Release",
    "Route",
    "Submit",
    "WorkerRef",
    "ALLOWED_DTYPES",
    "Abort",
    "ENGINE_ROLES",
    "Activations",
    "BlockEvent",
    "Blocks",
    "DecodeRequest",
    "Error",
    "Exists",
    "Failed",
    "FailureKind",
    "FetchPlan",
    "FinishReason",
    "FirstToken",
    "FrontendGone",
    "Get",
    "GetLayers",
    "Heartbeat",
    "KVLayer",
    "KVTransfer",
    "LayerSlices",
    "Leave",
    "Logprob",
    "Load",
    "MAX_DIMS",
    "Message",
    "ModelFacts",
    "Msg",
    "NodeInfo",
    "Ok",
    "PrefillDone",
    "PrefillRequest",
    "Keep",
    "ProtocolError",
    "Put",
    "Register",
    "Registered",
    "Remove",
    "Replicate",
    "Reregister",
    "Reserved",
    "Sampling",
    "ShmBlocks",
    "ShmGet",
    "ShmPut",
    "ShmRef",
    "StageDone",
    "StagePlan",
    "StatsQuery",
    "TensorSpec",
    "TierLoad",
    "TokenEvent",
    "TokenStep",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "orders_identity",
    "frame_tensor",
    "tensor_frame",
]

Message = Union[
    Register, Registered, Heartbeat, Leave, Reregister,
    Put, Get, GetLayers, Exists, Remove, Replicate, Keep, StatsQuery,
    Ok, Blocks, LayerSlices, Error, BlockEvent,
    DecodeRequest, Reserved, PrefillRequest, PrefillDone, FirstToken, KVTransfer, KVLayer, TokenEvent, TokenStep, Abort, FrontendGone, Failed,
    Activations, StageDone,
    Submit, Admitted, Refused, AttemptEnded, Release, Claims, ClusterQuery, ClusterView,
    ShmPut, ShmGet, ShmBlocks,
    P2PMessage,  # p2p.py: object metadata (conductor) and Forget (conductor -> store)
]  # fmt: skip

_TENSOR_HALF = {"ALLOWED_DTYPES", "MAX_DIMS", "dtype_from_name", "dtype_name", "frame_tensor", "tensor_frame"}


def _tensors() -> ModuleType:
    """The tensor half of the protocol (imports torch on first use)."""
    from mooncake.protocol import tensors

    return tensors


def __getattr__(name: str) -> Any:
    if name in _TENSOR_HALF:
        return getattr(_tensors(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg, tensors: Iterable[torch.Tensor] = ()) -> list:
    """Frames for ``msg``; tensors (if any) become payload frames and fill ``msg.tensors``.

    Returns the frame list; it holds references to the tensors so that they stay
    alive while ZeroMQ sends them without copying.
    """
    payload = []
    specs = []
    for t in tensors:
        spec, buf = _tensors().tensor_frame(t)
        specs.append(spec)
        payload.append(buf)
    if specs:
        msg.tensors = specs  # type: ignore[attr-defined]
    return [_encoder.encode(msg), *payload]


def decode(frames: Sequence[Any], block_shape: tuple[int, ...] | None = None,
           block_dtype: torch.dtype | None = None) -> tuple[Msg, list[torch.Tensor]]:
    """(message, tensors) from received frames. Raises ProtocolError, and nothing else, on
    anything malformed. With ``block_shape``, every tensor must be one KV block of that shape in
    ``block_dtype`` (None: any floating dtype), or for a ``KVLayer`` one layer of ``n`` blocks (for
    sockets that receive KV)."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        head = frames[0]
        head = head.bytes if hasattr(head, "bytes") else head
        msg = _decoder.decode(head)
        specs = getattr(msg, "tensors", None) or []
        if len(specs) != len(frames) - 1:
            raise ProtocolError(f"{type(msg).__name__} declares {len(specs)} tensors, got {len(frames) - 1} frames")
        if not specs:
            return msg, []
        tensors = _tensors()
        if block_shape is not None:
            layer = isinstance(msg, KVLayer)
            want = (-1, *block_shape[1:]) if layer else tuple(block_shape)
            for s in specs:
                shape = (-1, *s.shape[1:]) if layer and s.shape else tuple(s.shape)
                dtype = tensors.dtype_from_name(s.dtype)
                if shape != want or not (dtype == block_dtype if block_dtype is not None else dtype.is_floating_point):
                    raise ProtocolError(f"KV block {s.dtype}{list(s.shape)} is not a {list(block_shape)} "
                                        f"{tensors.dtype_name(block_dtype) if block_dtype is not None else 'float'} block")
        return msg, [tensors.frame_tensor(f, s) for f, s in zip(frames[1:], specs)]
    except ProtocolError:
        raise
    except Exception as e:  # msgspec errors, recursion limits, odd frame objects: all malformed
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
