"""A request's life at the frontend that owns it, as one state machine: its status, its
attempts, its events.

::

    WAITING ──submitted──▶ PLACED ──started──▶ DECODING ──tokens…──▶ FINISHED
       ▲                     │                    │
       └──── the attempt ended (failed, preempted, its node died): a new attempt ┘
                  any state ──finish (stop, length, abort, error)──▶ FINISHED

An attempt is one try on one prefill/decode pair, placed by the conductor; workers and the
conductor know it by its wire id (``<request id>#<attempt>``), so a message of an earlier
attempt matches nothing. Tokens carry their index among the request's generated tokens:
they are emitted in index order whatever path (the prefill's first token in its
``PrefillDone``, decode's stream to this frontend's token socket) they came by, and an index already
emitted is a duplicate. The HTTP layer reads the typed events from ``events``; only this
module changes a request's state.
"""

from __future__ import annotations

import asyncio
import enum
import math
import uuid
from dataclasses import dataclass, field

from mooncake.blocks import extend_chain, hash_blocks, root_hash
from mooncake.frontend.timeline import Timeline
from mooncake.protocol import FinishReason, Logprob, ModelFacts, Sampling
from mooncake.tracing.context import current_traceparent


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not (or no longer) on any instance: an attempt is being placed
    PLACED = "placed"  # an attempt is placed: decode reserving, prefill computing
    DECODING = "decoding"  # first token out, the decode instance streams the rest
    FINISHED = "finished"


_NEXT = {
    RequestStatus.WAITING: {RequestStatus.PLACED},
    RequestStatus.PLACED: {RequestStatus.DECODING, RequestStatus.WAITING},
    RequestStatus.DECODING: {RequestStatus.WAITING},
    RequestStatus.FINISHED: set(),
}


class TransitionError(RuntimeError):
    """A transition the state machine does not allow (a bug, never a peer's fault)."""


@dataclass(frozen=True)
class RequestError:
    """Why a request failed: what the client is told."""

    message: str
    status: int = 503  # 400 for requests no instance can serve (a FATAL failure)
    param: str | None = None
    code: str = "worker_failed"


@dataclass(frozen=True)
class Tokens:
    """Event: new generated tokens, in order (with their logprobs when the request asked)."""

    ids: list[int]
    logprobs: list | None = None


@dataclass(eq=False)
class FrontendAttempt:
    """One try of a request, as its frontend knows it."""

    number: int
    wire_id: str
    decode: str  # the decode instance: only its tokens are accepted
    started: float
    first_token_at: float = 0.0  # when its prefill's token came
    tokens_before: int = 0  # tokens generated before that one (earlier attempts)


@dataclass(frozen=True)
class Finished:
    """Event: the last one of a request."""

    reason: FinishReason
    error: RequestError | None = None


def request_id(client_id: str) -> str:
    """A unique request id, led by the client's own id when it sent one."""
    suffix = uuid.uuid4().hex[:16]
    return f"{client_id}-{suffix[:8]}" if client_id else f"req-{suffix}"


@dataclass(eq=False)
class Request:
    req_id: str
    tokens: list[int]  # the prompt
    hashes: list[bytes]  # the prompt's full blocks
    root: bytes  # the hash chain's seed (model identity + cache salt)
    sampling: Sampling
    arrived: float
    status: RequestStatus = RequestStatus.WAITING
    attempt: FrontendAttempt | None = None
    attempts: int = 0
    migrations: int = 0  # attempts moved after a failure (preemptions do not count)
    generated: list[int] = field(default_factory=list)
    held: dict[int, list[int]] = field(default_factory=dict)  # index -> tokens that came early
    held_logprobs: dict[int, list] = field(default_factory=dict)  # index -> their logprobs, if any
    decode_finished: FinishReason | None = None  # the current attempt's decode sent its last token
    followers: list["Request"] = field(default_factory=list)  # choices of the same prompt waiting for its KV
    forks: int = 0  # choices forked from this one (``Frontend.fork``)
    cached_tokens: int = 0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    last_progress: float = 0.0
    finish_reason: FinishReason | None = None
    error: RequestError | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    trace: str | None = None  # the traceparent of its frontend span (``mooncake/tracing``): its attempts carry it
    timeline: Timeline = field(init=False)  # where its time went (``timeline.py``)

    def __post_init__(self) -> None:
        self.timeline = Timeline(self.arrived)

    @classmethod
    def new(cls, tokens: list[int], sampling: Sampling, facts: ModelFacts, now: float, cache_salt: str = "",
            client_id: str = "") -> Request:
        """A request for the prompt ``tokens``, its blocks hashed under the model (and ``cache_salt``);
        ``client_id`` (the client's X-Request-Id) leads its id."""
        salt = cache_salt or None
        return cls(request_id(client_id), list(tokens), hash_blocks(tokens, facts.block_tokens, facts.model_id, salt),
                   root_hash(facts.model_id, salt), sampling, now, trace=current_traceparent())

    @property
    def wire_id(self) -> str:
        return self.attempt.wire_id if self.attempt else ""

    @property
    def next_wire_id(self) -> str:
        """The wire id the next attempt will have (its booking's)."""
        return f"{self.req_id}#{self.attempts + 1}"

    def skip_attempt(self) -> str:
        """Give up the next wire id (it may have reached a conductor that died: it stays that
        attempt's) and return the one after it."""
        self.attempts += 1
        return self.next_wire_id

    @property
    def done(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def _to(self, status: RequestStatus) -> None:
        if status not in _NEXT[self.status]:
            raise TransitionError(f"{self.req_id}: {self.status.value} -> {status.value}")
        self.status = status

    # ------------------------------------------------------------ transitions

    def placed(self, decode: str, now: float) -> FrontendAttempt:
        """A new attempt (``next_wire_id``), placed with ``decode`` streaming its tokens."""
        self._to(RequestStatus.PLACED)
        self.attempts += 1
        self.attempt = FrontendAttempt(self.attempts, f"{self.req_id}#{self.attempts}", decode, now)
        self.held.clear()
        self.held_logprobs.clear()
        self.decode_finished = None
        self.last_progress = now
        return self.attempt

    def hold(self, index: int, ids: list[int], logprobs: list | None = None) -> None:
        """Tokens that came from decode before the prefill's first token (they are emitted after it)."""
        self.held[index] = ids
        if logprobs:
            self.held_logprobs[index] = logprobs

    def prefilled(self, first_token: int, cached_tokens: int, now: float, logprob: Logprob | None = None) -> bool:
        """The attempt's prefill is done; its first token is emitted. Returns whether it is
        the request's first token (the time to first token)."""
        self._to(RequestStatus.DECODING)
        assert self.attempt is not None
        self.attempt.first_token_at, self.attempt.tokens_before = now, len(self.generated)
        first = not self.generated
        if first:
            self.cached_tokens = cached_tokens
            self.first_token_at = now
        self.accept(len(self.generated), [first_token], now, [logprob] if logprob is not None else None)
        return first

    def accept(self, index: int, ids: list[int], now: float, logprobs: list | None = None) -> int:
        """Tokens ``index`` onwards (and their logprobs); emits what is next in order. Returns
        how many were emitted."""
        if self.status is not RequestStatus.DECODING:
            raise TransitionError(f"{self.req_id}: tokens while {self.status.value}")
        self.hold(index, ids, logprobs)
        emitted = 0
        while self.held:
            at = len(self.generated)
            for i in [i for i in self.held if i + len(self.held[i]) <= at]:
                del self.held[i]  # wholly emitted already: a duplicate
                self.held_logprobs.pop(i, None)
            start = at if at in self.held else next((i for i in self.held if i < at), None)
            if start is None:
                break
            # a run that starts inside what was emitted contributes its unseen tail
            chunk = self.held.pop(start)[at - start:]
            lps = self.held_logprobs.pop(start, None)
            self.generated.extend(chunk)
            self.events.put_nowait(Tokens(list(chunk), lps[at - start:] if lps else None))
            emitted += len(chunk)
        if emitted:
            self.last_progress = self.last_token_at = now
        return emitted

    def requeued(self, now: float, counts_as_migration: bool) -> None:
        """The attempt ended without finishing the request: it waits for a new one."""
        self._to(RequestStatus.WAITING)
        self.attempt = None
        self.held.clear()
        self.held_logprobs.clear()
        if counts_as_migration:
            self.migrations += 1
        self.last_progress = now

    def finish(self, reason: FinishReason, error: RequestError | None = None) -> bool:
        """The end; returns False if it had already ended (finishing is idempotent)."""
        if self.done:
            return False
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.error = reason, error
        self.events.put_nowait(Finished(reason, error))
        return True

    @property
    def all_tokens(self) -> list[int]:
        """What a new attempt prefills: the prompt and what was generated so far."""
        return self.tokens + self.generated

    def first_token_due(self, ttft_slo_ms: float) -> float:
        """When its first token is due under a TTFT SLO (inf: no SLO, or it has its first token)."""
        return self.arrived + ttft_slo_ms / 1000 if ttft_slo_ms and not self.generated else math.inf

    def all_hashes(self, block_tokens: int) -> list[bytes]:
        """The full blocks of ``all_tokens``: the prompt's, then those of what was generated."""
        tail = self.all_tokens[len(self.hashes) * block_tokens:]
        return self.hashes + extend_chain(self.hashes[-1] if self.hashes else self.root, tail, block_tokens)
