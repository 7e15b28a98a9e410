"""The conductor's handlers of what the workers send it: registration, heartbeats and block
events; and what they report about the attempts they run: decode reserved the KV blocks,
prefill is done (the first token), tokens, a failure, a pipeline stage's times. A message of an
attempt that moved or ended changes nothing.

``WorkerMessages`` is a part of ``Conductor`` (a mixin): the conductor registers these handlers
with its router and provides the state they read and ``_send`` / ``_finish`` / ``_move``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from mooncake import protocol as P
from mooncake.conductor.forks import Forks
from mooncake.conductor.membership import Membership
from mooncake.conductor.pipeline import record_stage, stage_requests
from mooncake.conductor.request import Request, RequestError, RequestStatus
from mooncake.metrics import Metrics
from mooncake.sched.cluster import Node
from mooncake.sched.cost_model import CostModels
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.predictions import Predictions
from mooncake.sched.scheduler import Scheduler

log = logging.getLogger(__name__)
Reason = P.FinishReason


class WorkerMessages:
    """The conductor's handlers of the workers' messages (see the module docstring)."""

    membership: Membership
    attempts: dict[str, Request]
    _pending_prefill: dict[str, P.PrefillRequest]
    facts: P.ModelFacts | None
    model_name: str
    metrics: Metrics
    costs: CostModels
    predictions: Predictions
    scheduler: Scheduler
    index: KVIndex
    forks: Forks
    _send: Callable[[str, P.Msg], None]
    _finish: Callable[..., None]
    _move: Callable[..., None]

    def _attempt_of(self, node: Node, wire_id: str, role: str) -> Request | None:
        """The live request whose current attempt is ``wire_id`` and runs its ``role`` part on ``node``."""
        req = self.attempts.get(wire_id)
        if req is None or req.done or req.attempt is None:
            return None  # an attempt that moved or ended: its late messages change nothing
        plan = req.attempt.plan
        return req if (plan.prefill if role == "prefill" else plan.decode).node_id == node.node_id else None

    def _on_reserved(self, node: Node, msg: P.Reserved) -> None:
        req = self._attempt_of(node, msg.req_id, "decode")
        prefill = self._pending_prefill.pop(msg.req_id, None)
        if req is None or prefill is None or req.status is not RequestStatus.RESERVING:
            return
        req.reserved(time.monotonic())
        assert req.attempt is not None
        plan = req.attempt.plan
        if plan.stages:  # a pipeline group: every stage gets its part
            assert self.facts is not None
            for node_id, part in stage_requests(plan, prefill, self.facts.block_shape[0]):
                self._send(node_id, part)
            return
        self._send(plan.prefill.node_id, prefill)

    def _on_prefill_done(self, node: Node, msg: P.PrefillDone) -> None:
        if msg.stages == 1:  # a pipeline's time says nothing of one instance's prefill cost
            self.costs.observe_prefill(msg.computed_tokens, msg.cached_tokens, msg.prefill_s, msg.fetched_blocks,
                                       msg.fetch_s)
        req = self._attempt_of(node, msg.req_id, "prefill")
        if req is None or req.status is not RequestStatus.PREFILLING:
            return
        assert req.attempt is not None
        now = time.monotonic()
        if req.attempt.plan.stages:
            self.metrics.pipeline_requests.inc()
        else:
            a = req.attempt
            self.costs.observe_dispatch(a.plan, a.started, a.reserved_at, now, msg.prefill_s + msg.fetch_s)
        self.predictions.ttft(node.node_id, req.attempt.plan.est_ttft_s, now - req.attempt.started)
        self.scheduler.prefill_finished(msg.req_id)
        block_bytes = node.info.block_bytes
        self.metrics.kv_bytes.labels("store_to_prefill").inc(msg.fetched_blocks * block_bytes)
        if req.followers and not req.attempt.plan.stages:  # its prompt's blocks are on this prefill now
            self.index.add(node.node_id, "device", req.hashes)
            self.forks.release(req)
        if req.prefilled(msg.first_token, msg.cached_tokens, now, msg.logprob):
            m, name = self.metrics, self.model_name
            m.prefix_hits.labels(name).inc(msg.cached_tokens)
            m.ttft.labels(name).observe(now - req.arrived)
            m.queue_time.labels(name).observe(max(0.0, now - req.arrived - msg.prefill_s - msg.fetch_s))
            m.generation_tokens.labels(name).inc()
        else:
            self.metrics.generation_tokens.labels(self.model_name).inc()
        decode = req.attempt.plan.decode.node_id
        if msg.finished is not None:  # done at its first token: the decode drops its reservation
            self._finish(req, msg.finished)
            return
        n_tokens = len(req.tokens) + len(req.generated) - 1
        self.metrics.kv_bytes.labels("prefill_to_decode").inc(-(-n_tokens // self.facts.block_tokens) * block_bytes)
        self.metrics.kv_inflight_at_prefill_end.observe(msg.kv_pending_bytes)
        self._send(decode, P.FirstToken(msg.req_id, msg.first_token))

    def _on_tokens(self, node: Node, msg: P.TokenEvent) -> None:
        req = self._attempt_of(node, msg.req_id, "decode")
        if req is None or req.status is not RequestStatus.DECODING:
            return
        now = time.monotonic()
        last = req.last_token_at
        emitted = req.accept(msg.index, msg.tokens, now, msg.logprobs or None)
        if emitted:
            self.metrics.itl.labels(self.model_name).observe((now - last) / emitted)
            self.metrics.generation_tokens.labels(self.model_name).inc(emitted)
        if msg.finished is not None and not req.held:
            self._finish(req, msg.finished, notify=False)

    def _on_token_step(self, node: Node, msg: P.TokenStep) -> None:
        for event in msg.events:  # one request's trouble never costs the others their tokens
            try:
                self._on_tokens(node, event)
            except Exception:
                log.exception("error handling the tokens of %s from %s", event.req_id, node.node_id)

    def _on_failed(self, node: Node, msg: P.Failed) -> None:
        req = self.attempts.get(msg.req_id)
        if req is None or req.done or req.attempt is None or \
                node.node_id not in (*req.attempt.plan.prefill_ids, req.attempt.plan.decode.node_id):
            return  # a failure of an attempt that already moved or ended
        log.warning("%s failed %s (%s): %s", node.node_id, msg.req_id, msg.kind.value, msg.message)
        if msg.kind is P.FailureKind.FATAL:
            self._finish(req, Reason.ERROR, RequestError(msg.message, 400, msg.param or None, "invalid_request"))
        else:
            self._move(req, msg.message, preempted=msg.kind is P.FailureKind.PREEMPTED)

    def _on_stage_done(self, node: Node, msg: P.StageDone) -> None:
        req = self.attempts.get(msg.req_id)
        if req is not None and req.attempt is not None and node.node_id in req.attempt.plan.prefill_ids:
            record_stage(self.metrics, msg)

    def _on_block_event(self, node: Node, msg: P.BlockEvent) -> None:
        if msg.kind == "stored":
            self.index.add(node.node_id, msg.tier, msg.hashes)
        else:
            self.index.remove(node.node_id, msg.hashes)
        self.metrics.index_blocks.set(len(self.index))

    def _on_register(self, ident: bytes, msg: P.Register, peer: str = "") -> P.Msg:
        reply = self.membership.register(ident, msg, time.monotonic(), peer)
        profile = msg.info.profile
        if isinstance(reply, P.Registered) and profile is not None and self.costs.seed(msg.role, profile):
            self.scheduler.prefill_cost, self.scheduler.decode_cost = self.costs.prefill, self.costs.decode
        return reply

    def _on_heartbeat(self, node: Node, msg: P.Heartbeat) -> None:
        self.membership.heartbeat(node, msg.load, time.monotonic())
        if node.role == "decode":
            self.costs.observe_decode(msg.load.steps)
