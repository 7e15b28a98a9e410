"""The request path: frontend <-> prefill / decode (a frontend drives each attempt it owns), and
prefill -> decode (KV)."""

from __future__ import annotations

import enum

import msgspec

from mooncake.protocol.base import Msg, TensorSpec


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
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens are out
    min_p: float = 0.0
    presence_penalty: float = 0.0  # on tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # on prompt and generated tokens (>1 discourages)
    logit_bias: dict[int, float] = {}
    logprobs: int = -1  # -1: none; k >= 0: the chosen token's logprob and the k most likely
    grammar: str = ""  # an llguidance grammar (JSON) the output must match: a token mask on every step
    # the request's class (``sched/request_class.py``): which queued work a worker serves first
    request_class: str = "default"  # default | priority | flex (the API's ``service_tier``; never a store tier)
    priority: int = 0  # within a class, lower first
    fair_tag: float = 0.0  # within a class and priority, lower first: the tenants' fair order (frontend/tenant_clock.py)
    keep_s: float = 0.0  # a session's request: its KV blocks are kept this long after it ([classes] session_ttl_s)
    tenant: str = ""  # who sent it: its API key's id (``frontend/tenant_clock.tenant_id``, never the key); "" without keys
    speculative: bool = True  # False: never speculatively decoded (when the instance speculates)


class Logprob(msgspec.Struct, array_like=True):
    """The chosen token's log-probability under the model and the ``top`` most likely (id, logprob)."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class FetchPlan(msgspec.Struct, array_like=True):
    """Blocks ``[start, end)`` of the prompt's hash chain are to be read from ``endpoint``."""

    start: int
    end: int
    endpoint: str


class DecodeRequest(Msg, tag="decode_req"):
    """Frontend -> decode, at dispatch: reserve KV blocks for ``tokens`` (whose KV prefill
    will push) and answer ``Reserved`` once they are held. ``hashes`` are the full blocks'
    chained hashes, ``root`` the chain's seed (for blocks the generated tokens fill)."""

    req_id: str
    tokens: list[int]
    hashes: list[bytes]
    root: bytes
    sampling: Sampling
    num_generated: int = 0  # tokens produced by earlier attempts (they are part of ``tokens``)
    store_endpoint: str = ""  # where the blocks decode completes are written
    kv_token: bytes = b""  # random, per attempt: only KV carrying it is admitted (the prefill chosen has it)
    store_from_block: int = -1  # >= 0: write the prompt's full blocks from this one to the store as they become
    # whole here (a pipeline group's stages each hold only their layers, so none of them can)
    reply_to: str = ""  # the owning frontend's token endpoint: tokens go there, not to the conductor ("")
    fallback: bool = False  # placed by its frontend while no conductor led: reconciliation leaves it alone
    prefill_beside: bool = False  # its prefill shares this decode's machine: flex work yields the cores to it
    trace: str | None = None  # the W3C traceparent of the span this work continues (``mooncake/tracing``); None: untraced


class Reserved(Msg, tag="reserved"):
    """Decode -> frontend: the blocks for the request are held; its KV may come."""

    req_id: str
    node_id: str


class StagePlan(msgspec.Struct, array_like=True):
    """A prefill instance's part in a pipeline group (chunked pipeline parallelism): stage ``index``
    of ``stages`` computes layers ``[layer_lo, layer_hi)`` of every chunk, after reusing the
    group's ``prefix_blocks`` (each stage holds them: device cache or the fetch plan), and hands
    each chunk's hidden states to ``next_endpoint`` (the next stage's activation ingress; "" on
    the last stage, which samples the first token and reports ``PrefillDone``)."""

    index: int
    stages: int
    layer_lo: int
    layer_hi: int
    prefix_blocks: int
    next_endpoint: str = ""


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
    kv_token: bytes = b""  # the attempt's token: every KVTransfer to decode carries it
    stage: StagePlan | None = None  # set when the request runs on a pipeline group
    fallback: bool = False  # as DecodeRequest's
    store_range: list[int] = []  # [lo, hi): the chain's blocks to write to the store (empty: those it computes)
    trace: str | None = None  # the W3C traceparent of the span this work continues (``mooncake/tracing``); None: untraced


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
    logprob: Logprob | None = None  # the first token's, when the request asked for logprobs
    kv_pending_bytes: int = 0  # KV for decode not yet handed to the socket when the prefill sent this
    stages: int = 1  # > 1: sent by the last stage of a pipeline group (prefill_s is the pipeline's)


class Activations(Msg, tag="activations"):
    """Pipeline stage -> next stage: the hidden states after the stage's layers for positions
    ``[start, end)`` of a prompt chunk, one frame ``[end - start, hidden]``; ``token`` is the
    attempt's (as on KV), ``checksums`` one xxh3_64 over the frame."""

    req_id: str
    start: int
    end: int
    tensors: list[TensorSpec] = []
    token: bytes = b""
    checksums: list[int] = []


class StageDone(Msg, tag="stage_done"):
    """Pipeline stage -> frontend, once its part of a prefill is computed: its compute and idle
    (waiting for the previous stage) seconds, activation bytes it sent, KV still queued for decode."""

    req_id: str
    node_id: str
    stage: int
    compute_s: float
    idle_s: float
    activation_bytes: int = 0
    kv_pending_bytes: int = 0


class FirstToken(Msg, tag="first_token"):
    """Frontend -> decode: the token prefill sampled; decoding starts from it once all KV is in."""

    req_id: str
    token: int


class KVTransfer(Msg, tag="kv"):
    """Prefill -> decode: the request's KV blocks ``first_block`` onwards, one frame per block.
    Decode knows from its ``DecodeRequest`` how many blocks make the whole; it admits the KV only
    with the attempt's ``token`` and blocks whose bytes match ``checksums`` (xxh3_64, one per block,
    computed by the prefill that computed or imported them)."""

    req_id: str
    first_block: int
    tensors: list[TensorSpec] = []
    token: bytes = b""
    checksums: list[int] = []


class KVLayer(Msg, tag="kv_layer"):
    """Prefill -> decode: one layer of the request's KV blocks ``first_block`` onwards, sent as soon
    as the prefill computed that layer (layer-wise KV). One frame ``[n, 2, kv_heads, block_tokens,
    head_dim]`` (``pool[blocks, layer]``); ``checksums`` holds one xxh3_64 over it (per transfer).
    Decode writes it into the reserved blocks and uses a block once all its layers are in."""

    req_id: str
    first_block: int
    layer: int
    tensors: list[TensorSpec] = []
    token: bytes = b""
    checksums: list[int] = []


class TokenEvent(Msg, tag="tokens"):
    """Decode -> the request's frontend (``DecodeRequest.reply_to``): generated tokens ``index`` onwards (``index`` counts the request's
    generated tokens before these); ``finished`` set on the last."""

    req_id: str
    index: int
    tokens: list[int]
    finished: FinishReason | None = None
    logprobs: list[Logprob] = []  # one per token, when the request asked for logprobs


class TokenStep(Msg, tag="token_step"):
    """Decode -> frontend: one decode step's ``TokenEvent`` for each of several of its requests, in one
    message (the frontend receives and decodes a batch of n once, not n times)."""

    events: list[TokenEvent]


class Abort(Msg, tag="abort"):
    req_id: str
    term: int = 0  # from the conductor: its leader's term (``term_fence.py``); a frontend's: 0


class FrontendGone(Msg, tag="frontend_gone"):
    """Conductor -> every prefill and decode instance: this frontend process died; drop every
    attempt it ordered (nobody will read those streams), those it placed itself while no
    conductor led too. A process that restarted under the same node id orders as another
    (``orders_identity``), so what it orders is not dropped."""

    node_id: str
    instance: str = ""  # the process start that died (``NodeInfo.instance``; "" from a frontend without one)
    pid: int = 0  # ... and its pid, which such a frontend ordered under
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


def orders_identity(node_id: str, instance: str) -> bytes:
    """The routing id a frontend process's orders come from (on every worker's ``orders`` socket)."""
    return f"{node_id}@{instance}".encode()


class Failed(Msg, tag="failed"):
    """Worker -> frontend: a request could not be served here (reported once)."""

    req_id: str
    node_id: str
    message: str
    kind: FailureKind = FailureKind.RETRY
    param: str = ""  # FATAL: the request field at fault
