"""The conductor: admits requests, has the scheduler plan them, and drives each one's
life across the instances until it finishes. Its handlers of the workers' messages: worker_messages.py.

One attempt of a request (see ``request.py`` for the states)::

    conductor ──DecodeRequest──▶ decode      reserves the KV blocks, answers Reserved
    conductor ──PrefillRequest─▶ prefill     computes, pushes KV to decode, reports PrefillDone
    conductor ──FirstToken─────▶ decode      starts decoding once all KV is in, streams TokenEvents
                                             (a step's for all its requests in one TokenStep)

A failure is reported once, with its kind: RETRY moves the request to a new
attempt (at most ``max_migrations`` times), PREEMPTED requeues it without
counting, FATAL ends it with a client error. A node that dies, stalls or
restarts takes its attempts with it: they move. A request with no progress for
``request_timeout_s`` moves too, then fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from typing import Any

from mooncake import protocol as P
from mooncake.blocks import extend_chain, hash_blocks, root_hash
from mooncake.conductor.expected_model import ExpectedModel
from mooncake.conductor.forks import Forks
from mooncake.conductor.membership import Membership
from mooncake.conductor.replicator import Replicator
from mooncake.conductor.request import Request, RequestError, RequestStatus
from mooncake.conductor.router import Router
from mooncake.conductor.worker_messages import WorkerMessages
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


def _request_id(client_id: str) -> str:
    """A unique request id, led by the client's own id when it sent one."""
    suffix = uuid.uuid4().hex[:16]
    return f"{client_id}-{suffix[:8]}" if client_id else f"req-{suffix}"


class Conductor(WorkerMessages):
    def __init__(self, cfg: Config, tokenizer: Any, model_name: str, expected: ExpectedModel | None = None) -> None:
        """``expected``: the model the engines must serve (from the conductor's own copy);
        None: the first engine to register decides."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.metrics.before_render = self._refresh_gauges
        self.cluster = Cluster()
        self.index = KVIndex()
        self.costs = CostModels(self.metrics)
        self.scheduler = Scheduler(cfg.conductor, self.cluster, self.index, self.costs.prefill, self.costs.decode)
        self.admission = Admission(cfg.conductor, self.metrics)
        self.predictions = Predictions(self.metrics)
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir, "conductor")
        self.membership = Membership(cfg.conductor, self.cluster, self.index, self.metrics,
                                     self.on_node_lost, expected, keys_required=self.curve is not None)
        self.requests: dict[str, Request] = {}
        self.attempts: dict[str, Request] = {}  # wire id of the current attempt -> request
        self._pending_prefill: dict[str, P.PrefillRequest] = {}  # sent once decode has reserved
        self.forks = Forks(self._start_choice)  # choices waiting for another choice's prefill (n > 1)
        self.router: Router | None = None
        self.p2p = P2PIndex(self.cluster, self._send)  # who holds which chunks of the P2P objects
        self.replicator = Replicator(cfg.conductor, self.cluster, self.index, self.metrics, self.curve)
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        r = self.router = Router(self.cfg.conductor.endpoint, self.cluster, self.curve, self._on_register,
                                 self.cfg.security.max_message_bytes or DEFAULT_MAX_MSG_BYTES)
        r.on(P.Heartbeat, self._on_heartbeat)
        r.on(P.Leave, lambda n, m: self.membership.leave(n))
        r.on(P.BlockEvent, self._on_block_event)
        r.on(P.Reserved, self._on_reserved)
        r.on(P.PrefillDone, self._on_prefill_done)
        r.on(P.TokenEvent, self._on_tokens)
        r.on(P.TokenStep, self._on_token_step)
        r.on(P.Failed, self._on_failed)
        r.on(P.StageDone, self._on_stage_done)
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
            root = root_hash(facts.model_id, cache_salt or None)
            req = Request(_request_id(request_id), list(tokens),
                          hash_blocks(tokens, facts.block_tokens, facts.model_id, cache_salt or None), root,
                          sampling, time.monotonic())
            rejection = self._dispatch(req)
            if rejection is None:
                self.requests[req.req_id] = req
                self._count_prompt(req)
                return req
        self.metrics.rejected.labels(rejection.reason).inc()
        return rejection

    def fork(self, leader: Request, sampling: P.Sampling) -> Request:
        """Another choice of ``leader``'s prompt (``n`` > 1), with its own ``sampling``; it starts
        once the leader's prefill is done and reuses its prompt's KV (``forks.py``)."""
        return self.forks.fork(leader, sampling)

    def _start_choice(self, req: Request) -> None:
        rejection = self._dispatch(req)
        if rejection is not None:
            self.metrics.rejected.labels(rejection.reason).inc()
            req.finish(Reason.ERROR, RequestError(rejection.message, rejection.status, None, rejection.reason))
            return
        self.requests[req.req_id] = req
        self._count_prompt(req)

    def _count_prompt(self, req: Request) -> None:
        self.metrics.prompt_tokens.labels(self.model_name).inc(len(req.tokens))
        self.metrics.prefix_queries.labels(self.model_name).inc(len(req.tokens))

    def _refresh_gauges(self) -> None:
        """The gauges read from live state, just before a scrape."""
        m, name = self.metrics, self.model_name
        waiting = sum(1 for r in self.requests.values() if r.status is RequestStatus.WAITING) + len(self.forks.waiting)
        m.num_waiting.labels(name).set(waiting)
        m.num_running.labels(name).set(len(self.requests) + len(self.forks.waiting) - waiting)
        decodes = self.cluster.of_role("decode")
        total = sum(n.info.num_blocks for n in decodes)
        m.kv_usage.labels(name).set(sum(n.load.used_blocks for n in decodes) / total if total else 0.0)

    def cancel(self, req_id: str) -> None:
        """Free everything the request holds, everywhere (client gone, stop string hit). Idempotent."""
        self.forks.cancel(req_id)
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, Reason.ABORT)

    def _dispatch(self, req: Request) -> Rejection | None:
        """A new attempt: plan the prompt + tokens so far, book it, ask decode to reserve."""
        facts = self.facts
        assert facts is not None
        tokens = req.all_tokens
        bt = facts.block_tokens
        tail = tokens[len(req.hashes) * bt:]
        hashes = req.hashes + extend_chain(req.hashes[-1] if req.hashes else req.root, tail, bt)
        shape = pipeline_shape(self.cfg, facts, self.cluster, self.scheduler.prefill_cost.fetch_block_s)
        slo_s = self.cfg.conductor.ttft_slo_ms / 1000
        now = time.monotonic()
        t0 = time.perf_counter()
        placed = place(self.scheduler, self.admission, req.next_wire_id, hashes, len(tokens),
                       req.sampling.max_tokens - len(req.generated), bt, now, pipeline=shape,
                       deadline=req.arrived + slo_s if slo_s and not req.generated else math.inf,
                       evidence=self.costs.evidence())
        self.metrics.decision.observe(time.perf_counter() - t0)
        if isinstance(placed, Rejection):
            return placed
        plan = placed.plan
        wire_id = req.dispatched(plan, now)
        self.attempts[wire_id] = req
        self.metrics.of_node(self.metrics.prefill_dispatched, plan.prefill.node_id).inc()
        kv_token = secrets.token_bytes(16)  # decode admits KV only from the prefill that got it
        self._send(plan.decode.node_id, P.DecodeRequest(
            wire_id, tokens, hashes, req.root, req.sampling, num_generated=len(req.generated),
            store_endpoint=plan.store_endpoint, kv_token=kv_token,
            store_from_block=plan.reusable_blocks if plan.stages else -1))
        self._pending_prefill[wire_id] = P.PrefillRequest(
            wire_id, tokens, hashes, req.root, req.sampling, plan.decode.endpoints["kv"],
            num_generated=len(req.generated), fetch=plan.fetch, store_endpoint=plan.store_endpoint,
            kv_token=kv_token)
        self.replicator.note_hits(hashes[: plan.reusable_blocks])
        return None

    def _send(self, node_id: str, msg: P.Msg) -> None:
        assert self.router is not None
        self.router.send(node_id, msg)

    # ------------------------------------------------------------ ending and moving attempts

    def _end_attempt(self, req: Request, notify: bool = True) -> None:
        """Release the current attempt's booking; with ``notify`` its workers drop it."""
        if req.attempt is None:
            return
        wire_id, plan = req.wire_id, req.attempt.plan
        self.scheduler.release(wire_id)
        self.attempts.pop(wire_id, None)
        self._pending_prefill.pop(wire_id, None)
        if notify:
            for node_id in {*plan.prefill_ids, plan.decode.node_id}:
                self._send(node_id, P.Abort(wire_id))

    def _finish(self, req: Request, reason: P.FinishReason, error: RequestError | None = None,
                notify: bool = True) -> None:
        """End a request: its workers drop it (unless they ended it themselves), its load is released."""
        if req.done:
            return
        a = req.attempt
        decoded = len(req.generated) - a.tokens_before - 1 if a is not None and a.first_token_at else 0
        if reason in (Reason.STOP, Reason.LENGTH) and decoded > 0:
            self.predictions.tbt(a.plan.decode.node_id, a.plan.est_tbt_s, (time.monotonic() - a.first_token_at) / decoded)
        self._end_attempt(req, notify)
        req.finish(reason, error)
        self.forks.release(req)
        self.requests.pop(req.req_id, None)
        self.metrics.e2e.labels(self.model_name).observe(time.monotonic() - req.arrived)
        outcome = {Reason.ABORT: "aborted", Reason.ERROR: "error"}.get(reason, "ok")
        self.metrics.requests.labels(outcome).inc()

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
            plan = req.attempt.plan if req.attempt else None
            if plan is not None and node.node_id in (*plan.prefill_ids, plan.decode.node_id):
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
