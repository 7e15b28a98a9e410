"""Frontend <-> conductor: a frontend owns its requests (tokens, retries, the client); the
conductor places each attempt and drives it to its first token.

::

    frontend ──Submit──────▶ conductor   admission + placement (one round trip)
    frontend ◀─Admitted/Refused──
    conductor ─▶ decode, prefill …       as before (reserve, prefill, first token)
    frontend ◀─Started───── conductor    the prefill's first token
    frontend ◀─TokenEvent/TokenStep── decode   every later token, straight from decode
    frontend ◀─AttemptEnded─ conductor   the attempt failed, was preempted, or its node died
    frontend ──Release─────▶ conductor   attempts that ended here (batched): bookings are released

A frontend registers like a worker (role ``frontend``, endpoint ``tokens``: where decodes
send its tokens) and heartbeats; heartbeats are answered with a ``ClusterView``.
"""

from __future__ import annotations

import msgspec

from mooncake.protocol.base import Msg
from mooncake.protocol.membership import ModelFacts
from mooncake.protocol.requests import FinishReason, Logprob, Sampling


class Submit(Msg, tag="submit"):
    """Frontend -> conductor: place an attempt of a request (its prompt and the tokens so far)."""

    wire_id: str  # <request id>#<attempt>
    node_id: str  # the frontend's
    tokens: list[int]
    hashes: list[bytes]
    root: bytes
    sampling: Sampling  # max_tokens: the request's, ``num_generated`` of them generated already
    num_generated: int = 0
    ttft_budget_s: float = 0.0  # > 0: the first token is due this many seconds from now (TTFT SLO)
    share_prefix: bool = False  # other choices of this prompt follow: index its blocks on the prefill at once
    in_flight: int = 0  # requests the frontend holds besides this one (admission counts them cluster-wide)
    new_request: bool = False  # a request's first attempt: admission checks it against the cluster's limits


class Admitted(Msg, tag="admitted"):
    """Conductor -> frontend: the attempt is placed; ``decode`` will stream its tokens."""

    wire_id: str
    decode: str  # node id of the decode instance (only its tokens are accepted)
    prefill: str = ""
    max_tokens: int = 0  # clamped to the context


class Refused(Msg, tag="refused"):
    """Conductor -> frontend: the attempt cannot be placed (an HTTP error for a new request)."""

    wire_id: str
    status: int
    reason: str
    message: str
    param: str = ""
    retry_after_s: float = 0.0


class Started(Msg, tag="started"):
    """Conductor -> frontend: the attempt's prefill is done; its first token."""

    wire_id: str
    first_token: int
    cached_tokens: int
    prefill_s: float = 0.0
    fetch_s: float = 0.0
    finished: FinishReason | None = None
    logprob: Logprob | None = None


class AttemptEnded(Msg, tag="attempt_ended"):
    """Conductor -> frontend: the attempt ended without finishing the request (its workers dropped
    it). ``kind``: ``retry`` (another attempt may serve it), ``preempted`` (resume, not counted),
    ``fatal`` (a client error: ``status``/``param``)."""

    wire_id: str
    kind: str
    message: str
    status: int = 503
    param: str = ""


class Ended(msgspec.Struct, array_like=True):
    """One attempt that ended at the frontend: ``abort`` if its workers must drop it (cancelled);
    ``decoded`` tokens in ``decode_s`` (the TBT the decode delivered, for the predictions)."""

    wire_id: str
    abort: bool = False
    decoded: int = 0
    decode_s: float = 0.0


class Release(Msg, tag="release"):
    """Frontend -> conductor: attempts that ended (batched): their bookings are released."""

    node_id: str
    ended: list[Ended] = []


class ClusterQuery(Msg, tag="cluster_query"):
    """Frontend -> conductor: the cluster as ``GET /cluster`` shows it."""

    node_id: str = ""


class WorkerRef(msgspec.Struct, array_like=True):
    """A prefill or decode instance as a frontend needs it to place attempts with no conductor
    (``frontend/fallback.py``): where it takes orders and, for decode, where its KV goes."""

    node_id: str
    role: str
    orders: str
    kv: str = ""


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
