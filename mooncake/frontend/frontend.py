"""A frontend: the requests of its clients, from admission to their last token. Stateless as far
as the cluster goes: it holds only its own requests, and any number run side by side.

For each request it asks the conductor to place an attempt (``Submit``, one round trip:
``Admitted`` with the attempt's route, or ``Refused``), drives the attempt along the route to
its first token (``attempt_driver.py``), and decode streams the rest straight here
(``token_inlet.py``). The conductor hears, batched (``Release``), when each prefill is done
and when each attempt ends here (finished, cancelled), and releases the bookings. When an
attempt fails (a worker's ``Failed``, or a node died: the conductor's ``AttemptEnded``) the
frontend gives the request a new attempt with the prompt and the tokens so far, at most
``max_migrations`` times (preemptions do not count). A request with no progress for
``request_timeout_s`` moves too, then fails. While no conductor leads, the frontend places
attempts itself over the workers last known (``fallback.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import msgspec
import zmq.asyncio

from mooncake import protocol as P
from mooncake.api.text_codec import Codec
from mooncake.config import Config
from mooncake.frontend.attempt_driver import AttemptDriver, DrivenAttempt
from mooncake.frontend.conductor_client import ConductorClient
from mooncake.frontend.fallback import FallbackPlacer
from mooncake.frontend.forks import Forks
from mooncake.frontend.request import Request, RequestError, RequestStatus
from mooncake.frontend.request_metrics import RequestMetrics
from mooncake.frontend.tenant_clock import TenantClock
from mooncake.frontend.token_inlet import TokenInlet
from mooncake.metrics import Metrics
from mooncake.sched.admission import Rejection
from mooncake.sched.request_class import limit
from mooncake.security import Curve
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES

log = logging.getLogger(__name__)
Reason = P.FinishReason


class Frontend:
    def __init__(self, cfg: Config, tokenizer: Any, model_name: str, metrics: Metrics | None = None,
                 node_id: str = "") -> None:
        """``metrics``: a registry to count in (the conductor's, when both share a process)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.codec = Codec(tokenizer)  # text <-> ids, the hot paths' (prompts, streams)
        self.model_name = model_name
        self.node_id = node_id or cfg.node.node_id or f"{cfg.node.name}-frontend-{os.getpid()}"
        self.metrics = metrics or Metrics(model_name)
        self.stats = RequestMetrics(self.metrics, model_name, cfg.observability)
        self.metrics.before_render.append(lambda: self.stats.gauges(self.requests.values(), len(self.forks.waiting)))
        self.requests: dict[str, Request] = {}
        self.attempts: dict[str, Request] = {}  # wire id -> the request whose current attempt it is
        self.forks = Forks(self._start_choice)  # choices waiting for another choice's prefill (n > 1)
        self.tenants = TenantClock(cfg.classes.fair_token_ms / 1000)  # the fair order among API keys within a class
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir, "frontend", self.node_id)  # its own key
        self.ctx = zmq.asyncio.Context()
        self.conductor = ConductorClient(cfg, self.node_id, self._handle, self.metrics)
        self.inlet: TokenInlet | None = None
        self.driver: AttemptDriver | None = None
        self.fallback = FallbackPlacer()
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        max_bytes = self.cfg.security.max_message_bytes or DEFAULT_MAX_MSG_BYTES
        self.inlet = TokenInlet(self.ctx, self.cfg.node.host, self.cfg.frontend.token_port, self.curve,
                                self._on_tokens, max_bytes)
        driver = self.driver = AttemptDriver(self.ctx, self.curve, self.node_id, self.inlet.endpoint, max_bytes,
                                             self._on_prefilled, self._on_failed, self.stats.stage_done)
        register = P.Register("frontend", self.node_id, P.NodeInfo(self.cfg.node.name, os.getpid(), instance=P.process_instance()),
                              {"tokens": self.inlet.endpoint})
        await self.conductor.connect(self.ctx, self.curve, register, self.load, driver.claims)
        self.inlet.start()
        self._tasks += [asyncio.create_task(self._liveness_loop())]
        log.info("frontend %s registered; tokens come in on %s", self.node_id, self.inlet.endpoint)

    async def close(self) -> None:
        """After the HTTP drain, requests left have no client: their workers drop them."""
        self.forks.close("the server is shutting down")
        for req in list(self.requests.values()):
            self._finish(req, Reason.ABORT, RequestError("the server is shutting down"))
        await self.conductor.close()
        if self.driver is not None:
            self.driver.close()
        for t in self._tasks:
            t.cancel()
        if self.inlet is not None:
            self.inlet.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()

    @property
    def view(self) -> P.ClusterView:
        return self.conductor.view

    @property
    def ready(self) -> bool:
        return self.view.ready

    @property
    def facts(self) -> P.ModelFacts | None:
        return self.view.facts

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len if self.facts else 0

    def node_counts(self) -> dict[str, int]:
        return self.view.nodes

    def load(self) -> P.Load:
        waiting = sum(1 for r in self.requests.values() if r.status is RequestStatus.WAITING)
        return P.Load(running=len(self.requests) - waiting, waiting=waiting + len(self.forks.waiting))

    async def cluster_snapshot(self) -> dict:
        """What ``GET /cluster`` shows: the conductor's snapshot (asked now), with this frontend."""
        return {**await self.conductor.snapshot(), "frontend": self.node_id, "frontend_requests": len(self.requests)}

    # ------------------------------------------------------------ requests

    async def submit(self, tokens: list[int], sampling: P.Sampling, cache_salt: str = "",
                     request_id: str = "", choices: int = 1) -> Request | Rejection:
        """Admit and place a request; a Rejection says why it is refused. ``request_id`` (the
        client's X-Request-Id) leads the request's id, so every role's logs carry it; ``choices``
        > 1: forks of it follow (its prompt's blocks are indexed on its prefill at once)."""
        if self.facts is None:
            return Rejection(503, "no_workers", "no worker has registered yet", retry_after_s=1)
        if tokens and (min(tokens) < 0 or max(tokens) >= self.facts.vocab_size):
            bad = min(tokens) if min(tokens) < 0 else max(tokens)
            return Rejection(400, "invalid_prompt",
                             f"prompt token id {bad} is outside the vocabulary [0, {self.facts.vocab_size})", "prompt")
        req = Request.new(tokens, sampling, self.facts, time.monotonic(), cache_salt, request_id)
        answer = await self._place(req, choices=choices)
        if isinstance(answer, Rejection):
            self.stats.refused(sampling, answer.reason)
            return answer
        self.stats.admitted(req)
        return req

    def fork(self, leader: Request, sampling: P.Sampling) -> Request:
        """Another choice of ``leader``'s prompt (``n`` > 1) with its own ``sampling`` (``forks.py``)."""
        return self.forks.fork(leader, sampling)

    def _start_choice(self, req: Request) -> None:
        self._tasks.append(asyncio.create_task(self._place_or_fail(req, admitted=True)))

    def cancel(self, req_id: str) -> None:
        """Free everything the request holds, everywhere (client gone, stop string hit). Idempotent."""
        self.forks.cancel(req_id)
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, Reason.ABORT)

    async def _place(self, req: Request, choices: int = 1, admitted: bool = False) -> P.Admitted | Rejection:
        """Ask the conductor for a new attempt of ``req`` (prompt + tokens so far). The request is
        this frontend's meanwhile (a cancel finds it); a first attempt refused leaves it none's.
        ``choices`` > 1: a new request whose forks follow (admitted with it, its prompt's blocks
        indexed on its prefill at once); ``admitted``: a fork's first attempt (its leader's admission
        counted it)."""
        assert self.facts is not None
        first = req.attempts == 0
        wire_id = req.next_wire_id
        due = req.first_token_due(limit(req.sampling, "ttft_slo_ms", self.cfg))
        in_flight = len(self.requests) - (req.req_id in self.requests) + len(self.forks.waiting)  # forks: admitted
        self.requests[req.req_id] = req
        msg = P.Submit(wire_id, self.node_id, req.all_tokens, req.all_hashes(self.facts.block_tokens), req.root,
                       req.sampling, len(req.generated), max(1e-3, due - time.monotonic()) if due < float("inf") else 0.0,
                       choices > 1, in_flight, new_request=first and not admitted, choices=choices, trace=req.trace)
        answer = await self.conductor.ask(msg)
        if answer is None and self.conductor.leaderless and self.driver is not None and \
                self.fallback.can_place(self.conductor.view.workers):
            self.conductor.release(P.Ended(wire_id, abort=True))  # in case a conductor placed it after all
            wire_id = req.skip_attempt()  # ... that attempt's wire id stays its own
            msg = msgspec.structs.replace(msg, wire_id=wire_id)
            answer = self.fallback.place(msg, self.max_model_len, self.driver.load())
            self.metrics.fallback_routed.inc()
        if answer is None:
            self.conductor.release(P.Ended(wire_id, abort=True))  # in case it was placed after all
            answer = P.Refused(wire_id, 503, "no_conductor", "no conductor answered; try again later", "", 1.0)
        if isinstance(answer, P.Refused):
            if first:
                self.requests.pop(req.req_id, None)
            return Rejection(answer.status, answer.reason, answer.message, answer.param or None,
                             answer.retry_after_s or None)
        if req.done:  # cancelled while it was being placed
            if answer.route.planned:  # nothing went to its workers yet: only the booking
                self.conductor.release(P.Ended(wire_id))
            return answer
        if not req.generated:
            req.sampling.max_tokens = answer.max_tokens
        req.placed(answer.route.decode.node_id, time.monotonic())
        self.attempts[wire_id] = req
        assert self.driver is not None
        self.driver.drive(msg, answer.route)
        return answer

    async def _place_or_fail(self, req: Request, why: str = "", admitted: bool = False) -> None:
        """A new attempt of a request that has had one (``why`` it moves), or a choice's first
        (``admitted``: it counts as a new request)."""
        try:
            answer = await self._place(req, admitted=admitted)
        except Exception as e:  # a bug here must not leave the request waiting forever
            log.exception("placing %s failed", req.req_id)
            answer = Rejection(500, "internal_error", f"{type(e).__name__}: {e}")
        if isinstance(answer, Rejection):
            if not req.done:
                self.requests.pop(req.req_id, None)
                error = RequestError(f"request failed: {why}; no instance to move it to ({answer.message})") if why \
                    else RequestError(answer.message, answer.status, answer.param, answer.reason)
                self._done(req, Reason.ERROR, error)
        elif admitted:
            self.stats.admitted(req)

    # ------------------------------------------------------------ ending and moving attempts

    def _end_attempt(self, req: Request, abort: bool) -> None:
        """This frontend is done with the current attempt: the conductor releases its booking
        (and with ``abort`` its workers drop it)."""
        a = req.attempt
        if a is None or self.attempts.pop(a.wire_id, None) is None:
            return
        decoded = len(req.generated) - a.tokens_before - 1 if a.first_token_at else 0
        self._release(P.Ended(a.wire_id, abort, max(0, decoded),
                              req.last_token_at - a.first_token_at if decoded > 0 else 0.0))

    def _release(self, ended: P.Ended) -> None:
        """The attempt's workers drop it (with ``abort``), and the conductor releases its booking
        (unless this frontend's fallback placed it and no conductor has adopted it)."""
        a = self.driver.end(ended.wire_id, ended.abort) if self.driver is not None else None
        if a is None:  # never driven here: the conductor has its workers drop it, if they must
            self.conductor.release(ended)
        elif a.booked:
            self.conductor.release(msgspec.structs.replace(ended, abort=False))

    def _finish(self, req: Request, reason: P.FinishReason, error: RequestError | None = None,
                abort: bool = True) -> None:
        """End a request: its workers drop it (unless they ended it themselves)."""
        if req.done:
            return
        self._end_attempt(req, abort)
        self._done(req, reason, error)

    def _done(self, req: Request, reason: P.FinishReason, error: RequestError | None) -> None:
        req.finish(reason, error)
        self.forks.release(req)
        self.requests.pop(req.req_id, None)
        self.stats.finished(req, reason, time.monotonic())

    def _move(self, req: Request, why: str, preempted: bool = False, abort: bool = False) -> None:
        """Give the request a new attempt (prompt + tokens so far) elsewhere or later."""
        self._end_attempt(req, abort)
        if not preempted and req.migrations >= self.cfg.admission.max_migrations:
            self._finish(req, Reason.ERROR, RequestError(f"request failed: {why}"))
            return
        req.requeued(time.monotonic(), counts_as_migration=not preempted)
        self.stats.moved(req, preempted)
        self._tasks.append(asyncio.create_task(self._place_or_fail(req, why)))

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.cfg.admission.request_timeout_s / 4))
            self.check_progress(time.monotonic())

    def check_progress(self, now: float) -> None:
        """A placed request with no progress for its class's ``request_timeout_s`` (flex work waits
        behind the rest, ``[classes.flex]``) moves (its workers drop the attempt),
        and fails once it may move no more."""
        for req in list(self.requests.values()):
            timeout = limit(req.sampling, "request_timeout_s", self.cfg)
            if req.status is not RequestStatus.WAITING and now - req.last_progress > timeout:
                self._move(req, f"no progress for {timeout:.0f}s", abort=True)

    # ------------------------------------------------------------ what the conductor and decodes say

    def _handle(self, msg: P.Msg) -> None:
        """What the conductor says of this frontend's attempts (beyond placing them): a node of
        one died, stalled or restarted (its booking is gone; the conductor told its workers to drop
        it, and so does the frontend: an order of its own may have overtaken the conductor's)."""
        if isinstance(msg, P.AttemptEnded):
            if self.driver is not None:  # its aborts too: they go after this frontend's orders, on their sockets
                self.driver.end(msg.wire_id, abort=True)
            self._attempt_failed(msg.wire_id, msg.kind, msg.message, msg.status, msg.param)
        else:
            log.warning("frontend ignores %s", type(msg).__name__)

    def _on_failed(self, a: DrivenAttempt, msg: P.Failed) -> None:
        """A worker could not serve an attempt: the others drop it, and the request moves (or
        fails, if the request itself is at fault)."""
        self._release(P.Ended(a.wire_id, abort=True))
        log.warning("%s failed %s (%s): %s", msg.node_id, msg.req_id, msg.kind.value, msg.message)
        fatal = msg.kind is P.FailureKind.FATAL
        self._attempt_failed(a.wire_id, msg.kind.value, msg.message, 400 if fatal else 503, msg.param)

    def _attempt_failed(self, wire_id: str, kind: str, message: str, status: int, param: str) -> None:
        req = self.attempts.pop(wire_id, None)
        if req is None or req.done:
            return
        if kind == P.FailureKind.FATAL.value:
            self._finish(req, Reason.ERROR, RequestError(message, status, param or None, "invalid_request"),
                         abort=False)
        else:
            self._move(req, message, preempted=kind == P.FailureKind.PREEMPTED.value)

    def _on_prefilled(self, a: DrivenAttempt, msg: P.PrefillDone, now: float) -> None:
        """An attempt's prefill is done: its first token (the conductor hears of it with the next
        batch; before the forks of its prompt are placed, which it must place by its blocks)."""
        if a.booked:
            self.conductor.prefilled(P.Prefilled(a.wire_id, msg, a.reserved_at - a.started, now - a.started))
        req = self.attempts.get(a.wire_id)
        if req is None or req.status is not RequestStatus.PLACED:
            return
        first = req.prefilled(msg.first_token, msg.cached_tokens, now, msg.logprob)
        self.stats.started(req, msg, now, first, a.reserved_at)
        if first:  # its tenant's clock charged the whole prompt: what came from a cache cost little
            self.tenants.refund(req.sampling.tenant, msg.cached_tokens)
        self.forks.release(req)  # its prompt's blocks are on the prefill now
        if msg.finished is not None:  # done at its first token (the driver had decode drop it)
            self._finish(req, msg.finished, abort=False)
        else:  # tokens that came before the first one are out now
            self._maybe_done(req)

    def _on_tokens(self, sender: str, msg: P.TokenEvent) -> None:
        req = self.attempts.get(msg.req_id)
        if req is None or req.attempt is None or req.attempt.decode != sender or req.done:
            self.metrics.tokens_refused.inc()
            return
        if msg.finished is not None:
            req.decode_finished = msg.finished
        if req.status is RequestStatus.PLACED:  # ahead of the first token (it comes from the prefill)
            req.hold(msg.index, msg.tokens, msg.logprobs or None)
            return
        now, last = time.monotonic(), req.last_token_at
        self.stats.tokens(req, req.accept(msg.index, msg.tokens, now, msg.logprobs or None), now - last)
        self._maybe_done(req)

    def _maybe_done(self, req: Request) -> None:
        """The decode said the request finished and every token up to then is out: it is done."""
        if req.decode_finished is not None and not req.held:
            self._finish(req, req.decode_finished, abort=False)
