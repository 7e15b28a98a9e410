"""Membership: every role <-> the conductor (registration, heartbeats, leaving)."""

from __future__ import annotations

import os
import secrets

import msgspec

from mooncake.protocol.base import Msg
from mooncake.protocol.engine_profile import EngineProfile
from mooncake.protocol.store import BlockEvent

ENGINE_ROLES = ("prefill", "decode", "colocated")  # the roles that run an engine

_instance: tuple[int, str] = (0, "")


def process_instance() -> str:
    """A random id of this process start, the same for all it sends: a restarted process differs
    from the one it replaces even where pids repeat (in a container every role may be pid 1)."""
    global _instance
    if _instance[0] != os.getpid():  # a forked child is another process
        _instance = (os.getpid(), secrets.token_hex(8))
    return _instance[1]

class ModelFacts(msgspec.Struct, frozen=True):
    """What an engine serves; every engine of a cluster must agree on these."""

    model_id: str
    block_tokens: int
    max_model_len: int
    vocab_size: int
    block_shape: tuple[int, ...] = ()  # one KV block: [layers, 2, kv_heads, block_tokens, head_dim]
    hidden_size: int = 0  # width of the hidden states a pipeline stage hands on, per token


class NodeInfo(msgspec.Struct, frozen=True):
    """Facts a role registers with. ``model``, ``num_blocks`` and ``block_bytes``: engine roles only."""

    node_name: str
    pid: int
    model: ModelFacts | None = None
    num_blocks: int = 0
    block_bytes: int = 0
    profile: EngineProfile | None = None  # what the engine measured of itself at start-up
    cpus: int = 0  # CPU cores the process may run on (engine roles)
    threads: int = 0  # compute threads the engine uses (engine roles)
    machine: str = ""  # the same for every process sharing one machine's cores (engine roles)
    instance: str = ""  # this process start's id (``process_instance``): a restart shows where pids repeat
    kv_block_bytes: int = 0  # one KV block as it travels and is stored ([model] kv_codec); 0: block_bytes
    step_tokens: int = 0  # a colocated instance's fixed tokens per step ([engine] step_tokens; 0: from its target)
    step_target_ms: float = 0.0  # a colocated instance's step time target while interactive work decodes

    @property
    def moved_block_bytes(self) -> int:
        """Bytes of one KV block on the wire and in stores (encoded), not in the pool."""
        return self.kv_block_bytes or self.block_bytes


class TierLoad(msgspec.Struct, frozen=True):
    used_bytes: int = 0
    capacity_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    evictions: int = 0
    flex_blocks: int = 0  # of ``blocks``, those only flex requests wrote (evicted first)
    flex_evictions: int = 0  # of ``evictions``, flex blocks
    session_blocks: int = 0  # of ``blocks``, those a session keeps (evicted last, for a while)


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
    steps: list[tuple[int, int, float]] = []  # decode: (batch, KV tokens, seconds) of its latest steps since the last heartbeat
    tiers: dict[str, TierLoad] = {}  # store: per tier
    kv_rejected: dict[str, int] = {}  # KV refused since start, by reason (forged or corrupt: a miss, recomputed)
    writes_dropped: int = 0  # worker: write-backs dropped since start (too many in flight)
    evicted: dict[str, int] = {}  # engine: device-cache blocks evicted since start, by class ("flex", "other", "session")
    kept_blocks: int = 0  # engine: of its cached blocks, those a session keeps
    speculative: dict[str, int] = {}  # engine: speculative decoding's totals since start (``SpeculativeCounts``)
    kept_by_tenant: dict[str, int] = {}  # engine, store: blocks kept per tenant (its id; "" without API keys), at most [classes] session_blocks_per_key each
    stale_terms: dict[str, int] = {}  # conductor messages refused since start for a stale term, by type (``term_fence.py``)
    written_by_tenant: dict[str, int] = {}  # store: bytes stored per tenant since start
    dropped_by_tenant: dict[str, int] = {}  # store: bytes past the tenant's write budget since start (``tiers/write_budget.py``)


class Register(Msg, tag="register"):
    role: str  # "prefill" | "decode" | "colocated" | "store" | "frontend"
    node_id: str
    info: NodeInfo
    endpoints: dict[str, str] = {}  # e.g. {"kv": "tcp://...", "store": "tcp://..."}
    holding: list[str] = []  # wire ids of the requests it holds (queued, reserved, running)
    fallback: list[str] = []  # of ``holding``, those a frontend placed itself while no conductor led


def routing_id(register: Register) -> bytes:
    """A role's routing id on the conductor's ROUTER: its node id and its process start's instance.
    A restarted role is a new peer there even while its old connection lingers (libzmq refuses a
    connection under a routing id in use: the restarted role would never be heard)."""
    return f"{register.node_id}@{register.info.instance or register.info.pid}".encode()


def node_of(routing_id: bytes) -> str:
    """The node id in a routing id (for messages that do not name their node)."""
    text = routing_id.decode(errors="replace")
    return text.rpartition("@")[0] or text


class Registered(Msg, tag="registered"):
    node_id: str
    heartbeat_s: float
    keep: list[str] = []  # of ``holding``, what the conductor still knows there: the rest is dropped
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class Heartbeat(Msg, tag="heartbeat"):
    """Node -> conductor, every ``heartbeat_s`` or sooner: its load, and what changed in the blocks
    it caches since its last one (``roles/block_events.py``). Any message says a node is alive; a
    frontend's ``Submit`` stands in for its heartbeat (``roles/conductor_link.py``)."""

    node_id: str
    load: Load = msgspec.field(default_factory=Load)
    blocks: list[BlockEvent] = []


class Leave(Msg, tag="leave"):
    """Worker -> conductor: I am shutting down; send me no new work (in-flight work finishes)."""

    node_id: str


class Reregister(Msg, tag="reregister"):
    """Conductor -> node: I do not know you (e.g. I restarted); register again."""
