"""The store's object API (client <-> store ROUTER), its block events, and its same-node
shared-memory fast path (see mooncake/tiers/shm.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from mooncake.protocol.base import Msg, TensorSpec


class Put(Msg, tag="put"):
    """Store blocks; one payload frame per hash, in order."""

    hashes: list[bytes]
    tensors: list[TensorSpec]
    model_id: str = ""
    checksums: list[int] = []  # xxh3_64 per block from the process that computed it; the store verifies
    flex: bool = False  # a flex request's blocks (``sched/request_class.py``): evicted first
    keep_s: float = 0.0  # a session's request's blocks: kept this long (evicted last until then)
    tenant: str = ""  # who keeps them (``Sampling.tenant``): its kept blocks count against its quota
    trace: str | None = None  # the W3C traceparent of the span this work continues (``mooncake/tracing``); None: untraced


class Get(Msg, tag="get"):
    """Fetch blocks. With ``prefix=True`` stop at the first missing block."""

    hashes: list[bytes]
    prefix: bool = False
    trace: str | None = None  # as Put's


class GetLayers(Msg, tag="get_layers"):
    """Fetch the leading run of present blocks layer by layer: the store answers with one
    ``LayerSlices`` per ``layers_per_frame`` layers, lowest layers first (a stream of replies to
    one request id), so that a reader can compute on early layers while later ones travel."""

    hashes: list[bytes]
    layers_per_frame: int = 1
    trace: str | None = None  # as Put's


class LayerSlices(Msg, tag="layer_slices"):
    """One reply of a ``GetLayers`` stream: layers ``[lo, hi)`` of the found blocks in one frame
    ``[n, hi - lo, 2, kv_heads, block_tokens, head_dim]`` (block ``i``'s slice is the contiguous byte
    range of block ``i``'s layout that holds those layers). ``checksums``: per whole block, as put,
    in every reply; the reader verifies them over the slices of all replies (xxh3 streams over the
    concatenated slices, which are the block's bytes in order). ``last``: the stream ends here."""

    hashes: list[bytes]
    lo: int
    hi: int
    tensors: list[TensorSpec] = []
    checksums: list[int] = []
    last: bool = False


class Exists(Msg, tag="exists"):
    hashes: list[bytes]


class Remove(Msg, tag="remove"):
    hashes: list[bytes]
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class Replicate(Msg, tag="replicate"):
    """Copy the given blocks (those present) to another store node."""

    hashes: list[bytes]
    target: str  # the target store's endpoint
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class Keep(Msg, tag="keep"):
    """Keep the given blocks (those present) for ``keep_s`` from now: a session's prefix, evicted
    after every block no session keeps until then (``[classes] session_ttl_s``)."""

    hashes: list[bytes]
    keep_s: float
    tenant: str = ""  # as Put's
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class StatsQuery(Msg, tag="stats"):
    pass


class Ok(Msg, tag="ok"):
    """Generic reply. ``count``: blocks stored / removed / replicated."""

    count: int = 0
    flags: list[bool] = []
    data: dict[str, Any] = {}


class Blocks(Msg, tag="blocks"):
    """Reply to Get: the blocks found, one payload frame each."""

    hashes: list[bytes]
    tensors: list[TensorSpec]
    checksums: list[int] = []  # per block, as put (0: not known to this store process); the reader verifies


class Error(Msg, tag="error"):
    message: str
    code: str = "bad_request"


class BlockEvent(Msg, tag="block_event"):
    """Store or engine -> conductor: blocks stored in / removed from a node's tier."""

    node_id: str
    kind: str  # "stored" | "removed"
    tier: str  # "device" | "dram" | "lmdb"
    hashes: list[bytes]


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
    checksums: list[int] = []  # as Put's
    flex: bool = False  # as Put's
    keep_s: float = 0.0  # as Put's
    tenant: str = ""  # as Put's
    trace: str | None = None  # as Put's


class ShmGet(Msg, tag="shm_get"):
    """Get whose reply bytes go into the client's ``segment`` (``size`` bytes) as far as they fit."""

    hashes: list[bytes]
    segment: str
    size: int
    prefix: bool = False
    trace: str | None = None  # as Put's


class ShmBlocks(Msg, tag="shm_blocks"):
    """Reply to ShmGet: the first ``len(blocks)`` found hashes are in the segment, the rest
    (that did not fit) follow as payload frames described by ``tensors``."""

    hashes: list[bytes]
    blocks: list[ShmRef]
    tensors: list[TensorSpec] = []
    checksums: list[int] = []  # as Blocks'
