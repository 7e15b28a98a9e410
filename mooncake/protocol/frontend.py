"""Frontend <-> conductor: a frontend owns its requests (tokens, retries, the client) and drives
their attempts; the conductor places and books each attempt.

::

    frontend ──Submit──────▶ conductor   admission + placement (one round trip)
    frontend ◀─Admitted(Route)/Refused──
    frontend ─▶ decode, prefill …        reserve, prefill, first token (``frontend/attempt_driver.py``)
    frontend ◀─TokenEvent/TokenStep── decode   every later token, straight from decode
    frontend ◀─AttemptEnded─ conductor   a node of the attempt died, stalled or restarted
    frontend ──Release─────▶ conductor   prefills done and attempts ended here (batched): the
                                         cost models learn, bookings are released
    frontend ──Claims──────▶ conductor   on registering again (a new leader, a restart, a return
                                         from leaderless): the attempts it drives, to adopt

A frontend registers like a worker (role ``frontend``, endpoint ``tokens``: where decodes
send its tokens) and heartbeats; heartbeats are answered with a ``ClusterView``.
"""

from __future__ import annotations

import msgspec

from mooncake.protocol.base import Msg
from mooncake.protocol.membership import ModelFacts
from mooncake.protocol.requests import FetchPlan, PrefillDone, Sampling, StagePlan


class Submit(Msg, tag="submit"):
    """Frontend -> conductor: place an attempt of a request (its prompt and the tokens so far)."""

    wire_id: str  # <request id>#<attempt>
    node_id: str  # the frontend's
    tokens: list[int]  # the prompt and the tokens so far; none on the way to the conductor (``for_conductor``)
    hashes: list[bytes]
    root: bytes
    sampling: Sampling  # max_tokens: the request's, ``num_generated`` of them generated already
    num_generated: int = 0
    ttft_budget_s: float = 0.0  # > 0: the first token is due this many seconds from now (TTFT SLO)
    share_prefix: bool = False  # other choices of this prompt follow: index its blocks on the prefill at once
    in_flight: int = 0  # requests the frontend holds besides this one (admission counts them cluster-wide)
    new_request: bool = False  # a request's first attempt: admission checks it against the cluster's limits
    n_tokens: int = 0  # len(tokens), what the conductor is told of them (set from ``tokens`` when 0)
    choices: int = 1  # a new request's choices (``n``): its forks are admitted with it, counted against the caps
    trace: str | None = None  # the W3C traceparent of the span this work continues (``mooncake/tracing``); None: untraced

    def __post_init__(self) -> None:
        if not self.n_tokens:
            self.n_tokens = len(self.tokens)

    def for_conductor(self) -> "Submit":
        """This attempt as the conductor is sent it: without its tokens (it needs only their
        number and the blocks' hashes; decoding a long prompt's ids cost it ~40 µs a request)."""
        return msgspec.structs.replace(self, tokens=[])


class WorkerRef(msgspec.Struct, array_like=True):
    """A prefill or decode instance as a frontend needs it to drive attempts on it: where it
    takes orders (``roles/orders.py``) and, for decode, where its KV goes."""

    node_id: str
    role: str
    orders: str
    kv: str = ""


class Route(msgspec.Struct, array_like=True):
    """Where an attempt runs and how its KV moves: what the frontend that drives it sends its
    workers. ``planned``: a conductor placed and booked it (False: the frontend's fallback did,
    while none led; workers leave such attempts out of a conductor's reconciliation)."""

    decode: WorkerRef
    prefills: list[WorkerRef]  # one instance, or a pipeline group's stages in order
    kv_token: bytes  # random, per attempt: decode admits KV only from this attempt's prefill
    fetch: list[FetchPlan] = []  # store segments the prefill reads, in chain order
    store_endpoint: str = ""  # where new blocks are written ("": none)
    stages: list[StagePlan] = []  # a pipeline group's, one per prefill
    store_from_block: int = -1  # a group's decode writes the prompt's blocks from this one to the store
    planned: bool = True
    prefill_beside: bool = False  # the prefill runs on the decode's machine (``NodeInfo.machine``): they share its cores
    store_range: list[int] = []  # [lo, hi): the chain's blocks the prefill writes to the store (empty: those it computes)
    decode_writes: bool = True  # the decode writes the blocks it completes to the store

    @property
    def node_ids(self) -> set[str]:
        return {self.decode.node_id, *(w.node_id for w in self.prefills)}


class Admitted(Msg, tag="admitted"):
    """Conductor -> frontend: the attempt is placed (``route``); its decode will stream its tokens."""

    wire_id: str
    route: Route
    max_tokens: int = 0  # clamped to the context
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class Refused(Msg, tag="refused"):
    """Conductor -> frontend: the attempt cannot be placed (an HTTP error for a new request)."""

    wire_id: str
    status: int
    reason: str
    message: str
    param: str = ""
    retry_after_s: float = 0.0
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class AttemptEnded(Msg, tag="attempt_ended"):
    """Conductor -> frontend: the attempt ended without finishing the request (its workers dropped
    it). ``kind``: ``retry`` (another attempt may serve it), ``preempted`` (resume, not counted),
    ``fatal`` (a client error: ``status``/``param``)."""

    wire_id: str
    kind: str
    message: str
    status: int = 503
    param: str = ""
    term: int = 0  # the leader's term (``term_fence.py``); 0: no election


class Ended(msgspec.Struct, array_like=True):
    """One attempt that ended at the frontend: ``abort`` if its workers must drop it (cancelled);
    ``decoded`` tokens in ``decode_s`` (the TBT the decode delivered, for the predictions)."""

    wire_id: str
    abort: bool = False
    decoded: int = 0
    decode_s: float = 0.0


class Prefilled(msgspec.Struct, array_like=True):
    """One attempt whose prefill is done, as its frontend saw it: what the prefill reported
    (``PrefillDone``) and when, in seconds since the frontend was told of its placement,
    decode had reserved (``reserved_s``) and the prefill reported (``prefilled_s``)."""

    wire_id: str
    done: PrefillDone
    reserved_s: float
    prefilled_s: float


class Release(Msg, tag="release"):
    """Frontend -> conductor, batched: prefills done (the booked prefill work is over; the cost
    models learn) and attempts that ended (their bookings are released)."""

    node_id: str
    ended: list[Ended] = []
    prefilled: list[Prefilled] = []


class Claim(msgspec.Struct, array_like=True):
    """An attempt a frontend drives, as it tells a conductor it registers with again."""

    submit: Submit
    route: Route
    prefilled: bool = False  # its prefill reported done


class Claims(Msg, tag="claims"):
    """Frontend -> conductor, after registering again: every attempt it drives. A new conductor
    adopts them (books them on their route; their workers keep them); one that ended an attempt
    (a node of it lost, its frontend declared dead) answers ``AttemptEnded`` and it moves."""

    node_id: str
    attempts: list[Claim] = []


class ClusterQuery(Msg, tag="cluster_query"):
    """Frontend -> conductor: the cluster as ``GET /cluster`` shows it."""

    node_id: str = ""


class ClusterView(Msg, tag="cluster_view"):
    """Conductor -> frontend (on heartbeats, on membership changes, on a query): who leads,
    what the cluster serves, whether it can serve, the workers (for placing while none leads)
    and (on a query) the ``/cluster`` snapshot."""

    leader: str
    facts: ModelFacts | None = None
    ready: bool = False
    nodes: dict[str, int] = {}  # live nodes per role
    snapshot: dict = {}
    workers: list[WorkerRef] = []
