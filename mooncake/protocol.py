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
block_tokens, head_dim]`` (see ``mooncake.engine``).
"""

from __future__ import annotations

import enum
import warnings
from typing import Any, Iterable, Sequence, Union

import msgspec
import torch

# ----------------------------------------------------------------- tensors


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]


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


# ----------------------------------------------------------------- errors


class ProtocolError(ValueError):
    """A frame or message that does not decode into the protocol."""


# ----------------------------------------------------------------- messages


class Msg(msgspec.Struct, tag_field="t", omit_defaults=True):
    """Base of every message; the subclass name is its tag."""


# ---- membership (every role <-> conductor)


class ModelFacts(msgspec.Struct, frozen=True):
    """What an engine serves; every engine of a cluster must agree on these."""

    model_id: str
    block_tokens: int
    max_model_len: int
    vocab_size: int
    block_shape: tuple[int, ...] = ()  # one KV block: [layers, 2, kv_heads, block_tokens, head_dim]


class NodeInfo(msgspec.Struct, frozen=True):
    """Facts a role registers with. ``model``, ``num_blocks`` and ``block_bytes``: engine roles only."""

    node_name: str
    pid: int
    model: ModelFacts | None = None
    num_blocks: int = 0
    block_bytes: int = 0


class TierLoad(msgspec.Struct, frozen=True):
    used_bytes: int = 0
    capacity_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    evictions: int = 0


class Load(msgspec.Struct):
    """What a heartbeat reports. ``progress`` counts completed engine steps and ``pending``
    says whether the engine has work: work pending with no progress means a stuck engine."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0  # engine: KV blocks free or evictable
    used_blocks: int = 0  # engine: KV blocks held by sequences
    sequences: int = 0  # engine: sequences holding blocks
    progress: int = 0
    pending: bool = False
    steps: list[tuple[int, float]] = []  # decode: (batch, seconds) of steps since the last heartbeat
    tiers: dict[str, TierLoad] = {}  # store: per tier


class Register(Msg, tag="register"):
    role: str  # "prefill" | "decode" | "store"
    node_id: str
    info: NodeInfo
    endpoints: dict[str, str] = {}  # e.g. {"kv": "tcp://...", "store": "tcp://..."}


class Registered(Msg, tag="registered"):
    node_id: str
    heartbeat_s: float


class Heartbeat(Msg, tag="heartbeat"):
    node_id: str
    load: Load = msgspec.field(default_factory=Load)


class Leave(Msg, tag="leave"):
    """Worker -> conductor: I am shutting down; send me no new work (in-flight work finishes)."""

    node_id: str


class Reregister(Msg, tag="reregister"):
    """Conductor -> node: I do not know you (e.g. I restarted); register again."""


# ---- store object API (client <-> store ROUTER)


class Put(Msg, tag="put"):
    """Store blocks; one payload frame per hash, in order."""

    hashes: list[bytes]
    tensors: list[TensorSpec]
    model_id: str = ""


class Get(Msg, tag="get"):
    """Fetch blocks. With ``prefix=True`` stop at the first missing block."""

    hashes: list[bytes]
    prefix: bool = False
    lease_s: float = 0.0  # >0: keep the returned blocks from eviction this long


class Exists(Msg, tag="exists"):
    hashes: list[bytes]


class PrefixQuery(Msg, tag="prefix"):
    """How many leading blocks of a hash chain are present."""

    hashes: list[bytes]


class Remove(Msg, tag="remove"):
    hashes: list[bytes]


class Replicate(Msg, tag="replicate"):
    """Copy the given blocks (those present) to another store node."""

    hashes: list[bytes]
    target: str  # the target store's endpoint


class StatsQuery(Msg, tag="stats"):
    pass


class Release(Msg, tag="release"):
    """Drop the leases taken by a Get."""

    hashes: list[bytes]


class Ok(Msg, tag="ok"):
    """Generic reply. ``count``: blocks stored / removed / present-prefix length."""

    count: int = 0
    flags: list[bool] = []
    data: dict[str, Any] = {}


class Blocks(Msg, tag="blocks"):
    """Reply to Get: the blocks found, one payload frame each."""

    hashes: list[bytes]
    tensors: list[TensorSpec]


class Error(Msg, tag="error"):
    message: str
    code: str = "bad_request"


class BlockEvent(Msg, tag="block_event"):
    """Store or engine -> conductor: blocks stored in / removed from a node's tier."""

    node_id: str
    kind: str  # "stored" | "removed"
    tier: str  # "device" | "dram" | "lmdb"
    hashes: list[bytes]


# ---- request path (conductor <-> prefill / decode, prefill -> decode)


class FinishReason(str, enum.Enum):
    """Why a request's generation ended (OpenAI's ``finish_reason`` for the first two)."""

    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled: client gone, stop string, server shutting down
    ERROR = "error"  # failed for good


class FailureKind(str, enum.Enum):
    """What a failure means for the request."""

    RETRY = "retry"  # this worker could not serve it; another may (counts against max_migrations)
    FATAL = "fatal"  # the request itself cannot be served anywhere (a 4xx for the client)
    PREEMPTED = "preempted"  # decode ran out of KV blocks and gave it back; resumed elsewhere or later


class Sampling(msgspec.Struct, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class FetchPlan(msgspec.Struct, array_like=True):
    """Blocks ``[start, end)`` of the prompt's hash chain are to be read from ``endpoint``."""

    start: int
    end: int
    endpoint: str


class DecodeRequest(Msg, tag="decode_req"):
    """Conductor -> decode, at dispatch: reserve KV blocks for ``tokens`` (whose KV prefill
    will push) and answer ``Reserved`` once they are held. ``hashes`` are the full blocks'
    chained hashes, ``root`` the chain's seed (for blocks the generated tokens fill)."""

    req_id: str
    tokens: list[int]
    hashes: list[bytes]
    root: bytes
    sampling: Sampling
    num_generated: int = 0  # tokens produced by earlier attempts (they are part of ``tokens``)
    store_endpoint: str = ""  # where the blocks decode completes are written


class Reserved(Msg, tag="reserved"):
    """Decode -> conductor: the blocks for the request are held; its KV may come."""

    req_id: str
    node_id: str


class PrefillRequest(Msg, tag="prefill_req"):
    req_id: str
    tokens: list[int]  # prompt + tokens generated by earlier attempts
    hashes: list[bytes]
    root: bytes
    sampling: Sampling
    decode_endpoint: str
    num_generated: int = 0
    fetch: list[FetchPlan] = []
    store_endpoint: str = ""  # where new full blocks are written


class PrefillDone(Msg, tag="prefill_done"):
    req_id: str
    node_id: str
    first_token: int
    cached_tokens: int
    computed_tokens: int
    prefill_s: float
    fetched_blocks: int = 0  # blocks read from a store
    fetch_s: float = 0.0
    finished: FinishReason | None = None  # set if the first token already ends the request


class FirstToken(Msg, tag="first_token"):
    """Conductor -> decode: the token prefill sampled; decoding starts from it once all KV is in."""

    req_id: str
    token: int


class KVTransfer(Msg, tag="kv"):
    """Prefill -> decode: the request's KV blocks ``first_block`` onwards, one frame per block.
    Decode knows from its ``DecodeRequest`` how many blocks make the whole."""

    req_id: str
    first_block: int
    tensors: list[TensorSpec] = []


class TokenEvent(Msg, tag="tokens"):
    """Decode -> conductor: generated tokens ``index`` onwards (``index`` counts the request's
    generated tokens before these); ``finished`` set on the last."""

    req_id: str
    index: int
    tokens: list[int]
    finished: FinishReason | None = None


class Abort(Msg, tag="abort"):
    req_id: str


class Failed(Msg, tag="failed"):
    """Worker -> conductor: a request could not be served here (reported once)."""

    req_id: str
    node_id: str
    message: str
    kind: FailureKind = FailureKind.RETRY
    param: str = ""  # FATAL: the request field at fault


# ---- store same-node fast path (shared memory; see mooncake/tiers/shm.py)


class ShmRef(msgspec.Struct, array_like=True, frozen=True):
    """A tensor at ``offset`` in a shared-memory segment."""

    offset: int
    spec: TensorSpec


class ShmPut(Msg, tag="shm_put"):
    """Put whose block bytes are in the client's shared-memory ``segment``, not in frames."""

    hashes: list[bytes]
    segment: str
    blocks: list[ShmRef]
    model_id: str = ""


class ShmGet(Msg, tag="shm_get"):
    """Get whose reply bytes go into the client's ``segment`` (``size`` bytes) as far as they fit."""

    hashes: list[bytes]
    segment: str
    size: int
    prefix: bool = False
    lease_s: float = 0.0


class ShmBlocks(Msg, tag="shm_blocks"):
    """Reply to ShmGet: the first ``len(blocks)`` found hashes are in the segment, the rest
    (that did not fit) follow as payload frames described by ``tensors``."""

    hashes: list[bytes]
    blocks: list[ShmRef]
    tensors: list[TensorSpec] = []


Message = Union[
    Register, Registered, Heartbeat, Leave, Reregister,
    Put, Get, Exists, PrefixQuery, Remove, Replicate, StatsQuery, Release,
    Ok, Blocks, Error, BlockEvent,
    DecodeRequest, Reserved, PrefillRequest, PrefillDone, FirstToken, KVTransfer, TokenEvent, Abort, Failed,
    ShmPut, ShmGet, ShmBlocks,
]  # fmt: skip

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
        spec, buf = tensor_frame(t)
        specs.append(spec)
        payload.append(buf)
    if specs:
        msg.tensors = specs  # type: ignore[attr-defined]
    return [_encoder.encode(msg), *payload]


def decode(frames: Sequence[Any], block_shape: tuple[int, ...] | None = None) -> tuple[Msg, list[torch.Tensor]]:
    """(message, tensors) from received frames. Raises ProtocolError, and nothing else, on
    anything malformed. With ``block_shape``, every tensor must be one KV block of that shape
    in a floating dtype (for sockets that receive KV)."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        head = frames[0]
        head = head.bytes if hasattr(head, "bytes") else head
        msg = _decoder.decode(head)
        specs = getattr(msg, "tensors", None) or []
        if len(specs) != len(frames) - 1:
            raise ProtocolError(f"{type(msg).__name__} declares {len(specs)} tensors, got {len(frames) - 1} frames")
        if block_shape is not None:
            for s in specs:
                if tuple(s.shape) != tuple(block_shape) or not dtype_from_name(s.dtype).is_floating_point:
                    raise ProtocolError(f"KV block {s.dtype}{list(s.shape)} is not a {list(block_shape)} float block")
        return msg, [frame_tensor(f, s) for f, s in zip(frames[1:], specs)]
    except ProtocolError:
        raise
    except Exception as e:  # msgspec errors, recursion limits, odd frame objects: all malformed
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
