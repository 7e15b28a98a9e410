"""The conductor: admits requests, has them placed (``sched.placement``), and drives each one's
life across the instances until it finishes, from what the workers report.

One attempt of a request (``attempt.py``; see ``request.py`` for the states)::

    conductor ──DecodeRequest──▶ decode      reserves the KV blocks, answers Reserved
    conductor ──PrefillRequest─▶ prefill     computes, pushes KV to decode, reports PrefillDone
    conductor ──FirstToken─────▶ decode      starts decoding once all KV is in, streams TokenEvents
                                             (a step's for all its requests in one TokenStep)

A message of an attempt that moved or ended changes nothing. A failure is reported once, with
its kind: RETRY moves the request to a new attempt (at most ``max_migrations`` times),
PREEMPTED requeues it without counting, FATAL ends it with a client error. A node that dies,
stalls or restarts takes its attempts with it: they move. A request with no progress for
``request_timeout_s`` moves too, then fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from mooncake import protocol as P
from mooncake.conductor.attempt import Attempt
from mooncake.conductor.expected_model import ExpectedModel
from mooncake.conductor.forks import Forks
from mooncake.conductor.membership import Membership
from mooncake.conductor.pipeline import record_stage, stage_requests
from mooncake.conductor.replicator import Replicator
from mooncake.conductor.request import Request, RequestError, RequestStatus
from mooncake.conductor.request_metrics import RequestMetrics
from mooncake.conductor.router import Router
from mooncake.config import Config
from mooncake.metrics import Metrics
from mooncake.p2p.index import P2PIndex
from mooncake.sched.admission import Admission, Rejection
from mooncake.sched.cluster import Cluster, Node
from mooncake.sched.cost_model import CostModels
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.pipeline import pipeline_shape
from mooncake.sched.placement import place
from mooncake.sched.predictions import Predictions
from mooncake.sched.scheduler import Scheduler
from mooncake.security import Curve
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES

log = logging.getLogger(__name__)
Reason = P.FinishReason


class Conductor:
    def __init__(self, cfg: Config, tokenizer: Any, model_name: str, expected: ExpectedModel | None = None) -> None:
        """``expected``: the model the engines must serve (from the conductor's own copy);
        None: the first engine to register decides."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.predictions = Predictions(self.metrics)
        self.stats = RequestMetrics(self.metrics, model_name, self.predictions)
        self.metrics.before_render = lambda: self.stats.gauges(self.requests.values(), len(self.forks.waiting),
                                                               self.cluster)
        self.cluster = Cluster()
        self.index = KVIndex()
        self.costs = CostModels(self.metrics)
        self.scheduler = Scheduler(cfg.conductor, self.cluster, self.index, self.costs.prefill, self.costs.decode)
        self.admission = Admission(cfg.conductor, self.metrics)
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir, "conductor")
        self.requests: dict[str, Request] = {}
        self.attempts: dict[str, Attempt] = {}  # wire id -> the current attempt of a request
        self.membership = Membership(cfg.conductor, self.cluster, self.index, self.metrics, self.on_node_lost,
                                     self.attempts, expected, keys_required=self.curve is not None)
        self.forks = Forks(self._start_choice)  # choices waiting for another choice's prefill (n > 1)
        self.router: Router | None = None
        self.p2p = P2PIndex(self.cluster, self._send)  # who holds which chunks of the P2P objects
        self.replicator = Replicator(cfg.conductor, self.cluster, self.index, self.metrics, self.curve)
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        r = self.router = Router(self.cfg.conductor.endpoint, self.cluster, self.curve, self._on_register,
                                 self.cfg.security.max_message_bytes or DEFAULT_MAX_MSG_BYTES)
        for msg_type, on in {P.Heartbeat: self._on_heartbeat, P.Leave: lambda n, m: self.membership.leave(n),
                             P.BlockEvent: self._on_block_event, P.Reserved: self._on_reserved,
                             P.PrefillDone: self._on_prefill_done, P.TokenEvent: self._on_tokens,
                             P.TokenStep: self._on_token_step, P.Failed: self._on_failed,
                             P.StageDone: self._on_stage_done}.items():
            r.on(msg_type, on)
        for msg_type, handler in self.p2p.handlers().items():
            r.answer(msg_type, handler)
        self._tasks += [asyncio.create_task(r.serve()), asyncio.create_task(self._liveness_loop())]
        log.info("conductor listening for roles on %s", r.endpoint)
        return r.endpoint

    async def close(self) -> None:
        """After the HTTP drain, requests left have no client: workers drop them, then close."""
        self.forks.close("the server is shutting down")
        for req in list(self.requests.values()):
            self._finish(req, Reason.ABORT, RequestError("the server is shutting down"))
        if self.router is not None:
            await self.router.flush()
        for t in self._tasks:
            t.cancel()
        self.replicator.close()
        if self.router is not None:
            self.router.close()

    @property
    def ready(self) -> bool:
        return bool(self.cluster.of_role("prefill")) and bool(self.cluster.of_role("decode"))

    @property
    def facts(self) -> P.ModelFacts | None:
        return self.membership.facts

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len if self.facts else 0

    # ------------------------------------------------------------ requests

    def submit(self, tokens: list[int], sampling: P.Sampling, cache_salt: str = "",
               request_id: str = "") -> Request | Rejection:
        """Admit, plan and dispatch a request; a Rejection says why it is refused. ``request_id``
        (the client's X-Request-Id) leads the request's id, so every role's logs carry it."""
        facts = self.facts
        pool = min(self.membership.largest_pool("prefill"), self.membership.largest_pool("decode"))
        rejection = self.admission.check_request(tokens, sampling, facts, pool, len(self.requests),
                                                 self.scheduler.waiting())
        if rejection is None:
            assert facts is not None
            sampling.max_tokens = min(sampling.max_tokens, facts.max_model_len - len(tokens))
            req = Request.new(tokens, sampling, facts, time.monotonic(), cache_salt, request_id)
            rejection = self._dispatch(req)
            if rejection is None:
                self.requests[req.req_id] = req
                self.stats.admitted(req)
                return req
        self.metrics.rejected.labels(rejection.reason).inc()
        return rejection

    def fork(self, leader: Request, sampling: P.Sampling) -> Request:
        """Another choice of ``leader``'s prompt (``n`` > 1) with its own ``sampling`` (``forks.py``)."""
        return self.forks.fork(leader, sampling)

    def _start_choice(self, req: Request) -> None:
        rejection = self._dispatch(req)
        if rejection is not None:
            self.metrics.rejected.labels(rejection.reason).inc()
            req.finish(Reason.ERROR, RequestError(rejection.message, rejection.status, None, rejection.reason))
            return
        self.requests[req.req_id] = req
        self.stats.admitted(req)

    def cancel(self, req_id: str) -> None:
        """Free everything the request holds, everywhere (client gone, stop string hit). Idempotent."""
        self.forks.cancel(req_id)
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, Reason.ABORT)

    def _dispatch(self, req: Request) -> Rejection | None:
        """A new attempt: place the prompt + tokens so far (plan, admit, book), ask decode to reserve."""
        facts = self.facts
        assert facts is not None
        tokens, bt = req.all_tokens, facts.block_tokens
        hashes = req.all_hashes(bt)
        shape = pipeline_shape(self.cfg, facts, self.cluster, self.scheduler.prefill_cost.fetch_block_s)
        now = time.monotonic()
        t0 = time.perf_counter()
        placed = place(self.scheduler, self.admission, req.next_wire_id, hashes, len(tokens),
                       req.sampling.max_tokens - len(req.generated), bt, now, pipeline=shape,
                       deadline=req.first_token_due(self.cfg.conductor.ttft_slo_ms),
                       evidence=self.costs.evidence())
        self.metrics.decision.observe(time.perf_counter() - t0)
        if isinstance(placed, Rejection):
            return placed
        attempt = req.dispatched(placed, now)
        self.attempts[attempt.wire_id] = attempt
        plan = attempt.plan
        self.metrics.of_node(self.metrics.prefill_dispatched, plan.prefill.node_id).inc()
        self._send(plan.decode.node_id, attempt.reserve_request(tokens, hashes))
        self.replicator.note_hits(hashes[: plan.reusable_blocks])
        return None

    def _send(self, node_id: str, msg: P.Msg) -> None:
        assert self.router is not None
        self.router.send(node_id, msg)

    # ------------------------------------------------------------ ending and moving attempts

    def _end_attempt(self, req: Request, notify: bool = True) -> None:
        """Release the current attempt's booking; with ``notify`` its workers drop it."""
        a = req.attempt
        if a is None:
            return
        a.booking.release()
        self.attempts.pop(a.wire_id, None)
        if notify:
            for node_id in a.nodes:
                self._send(node_id, P.Abort(a.wire_id))

    def _finish(self, req: Request, reason: P.FinishReason, error: RequestError | None = None,
                notify: bool = True) -> None:
        """End a request: its workers drop it (unless they ended it themselves), its load is released."""
        if req.done:
            return
        self._end_attempt(req, notify)
        req.finish(reason, error)
        self.forks.release(req)
        self.requests.pop(req.req_id, None)
        self.stats.finished(req, reason, time.monotonic())

    def _move(self, req: Request, why: str, preempted: bool = False) -> None:
        """Give the request a new attempt (prompt + tokens so far) elsewhere or later."""
        self._end_attempt(req)
        if not preempted and req.migrations >= self.cfg.conductor.max_migrations:
            self._finish(req, Reason.ERROR, RequestError(f"request failed: {why}"))
            return
        req.requeued(time.monotonic(), counts_as_migration=not preempted)
        (self.metrics.preemptions if preempted else self.metrics.migrations).inc()
        rejection = self._dispatch(req)
        if rejection is not None:
            self._finish(req, Reason.ERROR, RequestError(
                f"request failed: {why}; no instance to move it to ({rejection.message})"))

    def on_node_lost(self, node: Node, why: str) -> None:
        """A node died, stalled or restarted: its attempts move; its stores' clients go."""
        self.scheduler.forget_node(node.node_id)
        if node.role == "store":
            self.replicator.forget(node.endpoints.get("store", ""))
            self.p2p.drop_node(node.node_id)
        for req in list(self.requests.values()):
            if req.attempt is not None and node.node_id in req.attempt.nodes:
                self._move(req, why)

    async def _liveness_loop(self) -> None:
        cfg = self.cfg.conductor
        while True:
            await asyncio.sleep(min(0.5, cfg.dead_after_s / 4, cfg.stall_after_s / 4))
            try:
                self.check_liveness(time.monotonic())
            except Exception:  # the loop that finds failures must not fail itself
                log.exception("liveness check failed")

    def check_liveness(self, now: float) -> None:
        """Dead and stalled nodes lose their requests; a request with no progress for
        ``request_timeout_s`` moves (a migration), and fails once it may move no more."""
        self.membership.check(now)
        timeout = self.cfg.conductor.request_timeout_s
        for req in list(self.requests.values()):
            if not req.done and now - req.last_progress > timeout:
                self._move(req, f"no progress for {timeout:.0f}s")

    # ------------------------------------------------------------ what the workers report

    def _attempt_of(self, node: Node, wire_id: str, role: str) -> Attempt | None:
        """The live attempt ``wire_id`` if its ``role`` part runs on ``node`` (else it moved or ended)."""
        a = self.attempts.get(wire_id)
        return a if a is not None and not a.request.done and a.runs(role, node.node_id) else None

    def _on_reserved(self, node: Node, msg: P.Reserved) -> None:
        a = self._attempt_of(node, msg.req_id, "decode")
        if a is None or a.prefill is None or a.request.status is not RequestStatus.RESERVING:
            return
        prefill, a.prefill = a.prefill, None
        a.request.reserved(time.monotonic())
        if a.plan.stages:  # a pipeline group: every stage gets its part
            assert self.facts is not None
            for node_id, part in stage_requests(a.plan, prefill, self.facts.block_shape[0]):
                self._send(node_id, part)
            return
        self._send(a.plan.prefill.node_id, prefill)

    def _on_prefill_done(self, node: Node, msg: P.PrefillDone) -> None:
        if msg.stages == 1:  # a pipeline's time says nothing of one instance's prefill cost
            self.costs.observe_prefill(msg.computed_tokens, msg.cached_tokens, msg.prefill_s, msg.fetched_blocks,
                                       msg.fetch_s)
        a = self._attempt_of(node, msg.req_id, "prefill")
        if a is None or a.request.status is not RequestStatus.PREFILLING:
            return
        req, plan, now = a.request, a.plan, time.monotonic()
        if plan.stages:
            self.metrics.pipeline_requests.inc()
        else:
            self.costs.observe_dispatch(plan, a.started, a.reserved_at, now, msg.prefill_s + msg.fetch_s)
        a.booking.prefill_finished()
        if req.followers and not plan.stages:  # its prompt's blocks are on this prefill now
            self.index.add(node.node_id, "device", req.hashes)
            self.forks.release(req)
        first = req.prefilled(msg.first_token, msg.cached_tokens, now, msg.logprob)
        self.stats.prefilled(a, msg, node, now, first)
        if msg.finished is not None:  # done at its first token: the decode drops its reservation
            self._finish(req, msg.finished)
            return
        self.stats.handed_to_decode(req, msg, node.info.block_bytes, self.facts.block_tokens)
        self._send(plan.decode.node_id, P.FirstToken(msg.req_id, msg.first_token))

    def _on_tokens(self, node: Node, msg: P.TokenEvent) -> None:
        a = self._attempt_of(node, msg.req_id, "decode")
        if a is None or a.request.status is not RequestStatus.DECODING:
            return
        req, now, last = a.request, time.monotonic(), a.request.last_token_at
        self.stats.tokens(req.accept(msg.index, msg.tokens, now, msg.logprobs or None), now - last)
        if msg.finished is not None and not req.held:
            self._finish(req, msg.finished, notify=False)

    def _on_token_step(self, node: Node, msg: P.TokenStep) -> None:
        for event in msg.events:  # one request's trouble never costs the others their tokens
            try:
                self._on_tokens(node, event)
            except Exception:
                log.exception("error handling the tokens of %s from %s", event.req_id, node.node_id)

    def _on_failed(self, node: Node, msg: P.Failed) -> None:
        a = self.attempts.get(msg.req_id)
        if a is None or a.request.done or node.node_id not in a.nodes:
            return  # a failure of an attempt that already moved or ended
        log.warning("%s failed %s (%s): %s", node.node_id, msg.req_id, msg.kind.value, msg.message)
        if msg.kind is P.FailureKind.FATAL:
            self._finish(a.request, Reason.ERROR, RequestError(msg.message, 400, msg.param or None, "invalid_request"))
        else:
            self._move(a.request, msg.message, preempted=msg.kind is P.FailureKind.PREEMPTED)

    def _on_stage_done(self, node: Node, msg: P.StageDone) -> None:
        a = self.attempts.get(msg.req_id)
        if a is not None and node.node_id in a.plan.prefill_ids:
            record_stage(self.metrics, msg)

    def _on_block_event(self, node: Node, msg: P.BlockEvent) -> None:
        if msg.kind == "stored":
            self.index.add(node.node_id, msg.tier, msg.hashes)
        else:
            self.index.remove(node.node_id, msg.hashes)
        self.metrics.index_blocks.set(len(self.index))

    def _on_register(self, ident: bytes, msg: P.Register, peer: str = "") -> P.Msg:
        reply = self.membership.register(ident, msg, time.monotonic(), peer)
        if isinstance(reply, P.Registered) and msg.info.profile is not None and self.costs.seed(msg.role, msg.info.profile):
            self.scheduler.prefill_cost, self.scheduler.decode_cost = self.costs.prefill, self.costs.decode
        return reply

    def _on_heartbeat(self, node: Node, msg: P.Heartbeat) -> None:
        self.membership.heartbeat(node, msg.load, time.monotonic())
        if node.role == "decode":
            self.costs.observe_decode(msg.load.steps)
