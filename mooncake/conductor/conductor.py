"""The conductor: what must be global in a cluster — the registry and liveness, the KV index,
the scheduler and its bookings, cost models, admission, hot-block replication, sessions' prefixes
kept, P2P metadata.
Frontends own requests (``mooncake.frontend``) and drive their attempts; the conductor
places and books each attempt. It carries no per-token traffic, and per attempt it handles
one round trip and a share of two batches::

    frontend ──Submit──────────▶ conductor   admit, place, book; answers Admitted (the route) or Refused
    frontend ──▶ decode, prefill …           the frontend drives the attempt (frontend/attempt_driver.py)
    frontend ──Release─────────▶ conductor   batched: prefills done (the booked prefill work is over,
                                             the cost models learn), attempts ended (bookings released)

A report of an attempt that moved or ended changes nothing. A node that dies, stalls or restarts
takes its attempts with it: their workers drop them, and their owners hear it (``AttemptEnded``) and
move them; so with a frontend that dies (nobody will read its streams). A new leader, or a restarted
conductor, adopts what its frontends claim and its workers hold (``adoption.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from mooncake import protocol as P
from mooncake.conductor.adoption import Adoption, adopted_plan
from mooncake.conductor.attempt import Attempt, route_of
from mooncake.conductor.expected_model import ExpectedModel
from mooncake.conductor.membership import Membership
from mooncake.conductor.stage_plans import stage_plans
from mooncake.conductor.replicator import Replicator
from mooncake.conductor.session_keeper import SessionKeeper
from mooncake.conductor.attempt_metrics import AttemptMetrics
from mooncake.conductor.router import Router
from mooncake.conductor.snapshot import FrontendViews, cluster_view
from mooncake.config import Config
from mooncake.metrics import Metrics
from mooncake.p2p.index import P2PIndex
from mooncake.sched.admission import Admission, Rejection
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import CostModels
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.pipeline import pipeline_shape
from mooncake.sched.placement import place
from mooncake.sched.predictions import Predictions
from mooncake.sched.request_class import rank
from mooncake.sched.scheduler import Scheduler
from mooncake.security import Curve
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES
from mooncake.ticks import until_tick

log = logging.getLogger(__name__)


class Conductor:
    def __init__(self, cfg: Config, model_name: str, expected: ExpectedModel | None = None,
                 metrics: Metrics | None = None) -> None:
        """``expected``: the model the engines must serve (from the conductor's own copy);
        None: the first engine to register decides."""
        self.cfg = cfg
        self.model_name = model_name
        self.name = cfg.node.name
        self.leader_term = 0  # etcd's revision of its campaign key (roles/conductor.py), on all it orders; 0: no election
        self.metrics = metrics or Metrics(model_name)
        self.predictions = Predictions(self.metrics)
        self.stats = AttemptMetrics(self.metrics, model_name, self.predictions, cfg.observability)
        self.cluster = Cluster()
        self.index = KVIndex()
        self._refresh = [lambda: self.stats.kv_usage(self.cluster), lambda: self.metrics.index_blocks.set(len(self.index))]
        self.metrics.before_render += self._refresh  # taken back at close (a leader that leads again makes a new one)
        self.costs = CostModels(self.metrics)
        self.scheduler = Scheduler(cfg.conductor, self.cluster, self.index, self.costs.prefill, self.costs.decode)
        self.admission = Admission(cfg.admission, self.metrics, cfg.classes)
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir, "conductor")
        self.attempts: dict[str, Attempt] = {}  # wire id -> a live attempt
        live = cfg.liveness
        self.adoption = Adoption(live.dead_after_s + 2 * live.heartbeat_s)  # frontends and workers find this one
        self.membership = Membership(live, self.cluster, self.index, self.metrics, self.on_node_lost,
                                     self.attempts, self.adoption, expected, keys_required=self.curve is not None)
        self.router: Router | None = None
        self.p2p = P2PIndex(self.cluster, self._send,  # who holds which chunks of the P2P objects
                            lambda node_id, peer: self.curve is None or self.membership.peers.get(node_id) == peer)
        self.replicator = Replicator(cfg.replication, self.cluster, self.index, self.metrics, self.curve, lambda: self.leader_term)
        self.sessions = SessionKeeper(self.cluster, self.index, self.replicator.client)
        self.requests_in_flight: dict[str, int] = {}  # frontend -> requests it holds (admission counts them)
        self.views = FrontendViews(self)
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        r = self.router = Router(self.cfg.conductor.endpoint, self.cluster, self.curve, self._on_register,
                                 self.cfg.security.max_message_bytes or DEFAULT_MAX_MSG_BYTES, self.metrics, self.replicator.term)
        for msg_type, on in {P.Heartbeat: self._on_heartbeat, P.Leave: lambda n, m: self.membership.leave(n),
                             P.BlockEvent: self.membership.block_event, P.Submit: self.stats.traces.wrap(self._on_submit, self.attempts, self.cluster),
                             P.Release: self._on_release, P.Claims: self._on_claims}.items():
            r.on(msg_type, on)
        for msg_type, handler in self.p2p.handlers().items():
            r.answer(msg_type, handler)
        r.answer(P.ClusterQuery, lambda m, peer: self.view(snapshot=True))
        self._tasks += [asyncio.create_task(r.serve()), asyncio.create_task(self._liveness_loop())]
        self.adoption.begin(time.monotonic())
        log.info("conductor listening for roles on %s", r.endpoint)
        return r.endpoint

    async def close(self) -> None:
        """Stop (shut down, or no longer leading): the attempts run on under their frontends, which
        tell the next conductor of them (``adoption.py``); the socket closes."""
        if self.router is not None:
            await self.router.flush()
        self.metrics.before_render[:] = [f for f in self.metrics.before_render if f not in self._refresh]
        for t in self._tasks:
            t.cancel()
        self.replicator.close()  # and with it the clients a session's keeping uses
        if self.router is not None:
            self.router.close()

    @property
    def ready(self) -> bool:
        of = self.cluster.of_role
        return bool(of("colocated")) or (bool(of("prefill")) and bool(of("decode")))

    @property
    def facts(self) -> P.ModelFacts | None:
        return self.membership.facts

    def view(self, snapshot: bool = False) -> P.ClusterView:
        """What frontends are told of the cluster (with ``snapshot``: what ``GET /cluster`` shows)."""
        return cluster_view(self, snapshot=True) if snapshot else self.views.current()

    # ------------------------------------------------------------ placing attempts

    def _on_submit(self, node: Node, msg: P.Submit) -> None:
        # a fork's or a moved request's in_flight leaves it out, but it was admitted: it counts
        self.requests_in_flight[node.node_id] = msg.in_flight + (not msg.new_request)
        known = self.attempts.get(msg.wire_id)  # asked again (the frontend re-registered): the same answer
        placed = known if known is not None and known.owner == node.node_id else self.submit(msg)
        if msg.new_request and not isinstance(placed, Rejection):
            self.requests_in_flight[node.node_id] = msg.in_flight + msg.choices  # ... and this one, now
        if isinstance(placed, Rejection):
            self._send(node.node_id, P.Refused(msg.wire_id, placed.status, placed.reason, placed.message,
                                               placed.param or "", placed.retry_after_s or 0.0))
        elif placed.answered_to is not node:  # once per registration of its frontend (a new one may have lost it)
            placed.answered_to = node
            self._send(node.node_id, P.Admitted(msg.wire_id, placed.route, msg.sampling.max_tokens))

    def submit(self, msg: P.Submit) -> Attempt | Rejection:
        """Admit (a request's first attempt: its prompt and the cluster's limits), place and book an
        attempt; a Rejection says why it is refused."""
        facts = self.facts
        if msg.new_request:
            pool, cls = self.membership.largest_pool(), rank(msg.sampling)
            rejection = self.admission.check_request(msg.n_tokens, msg.sampling, facts, pool,
                                                     sum(self.requests_in_flight.values()),  # and its class's queue:
                                                     self.scheduler.waiting(cls), max(1, msg.choices), self.scheduler.in_flight(cls))
            if rejection is not None:
                self.metrics.rejected.labels(rejection.reason).inc()
                return rejection
        if facts is None:
            return Rejection(503, "no_workers", "no worker has registered yet", retry_after_s=1)
        if msg.num_generated == 0:  # what the context leaves (a moved request was clamped on its first)
            msg.sampling.max_tokens = max(1, min(msg.sampling.max_tokens, facts.max_model_len - msg.n_tokens))
        placed = self._place(msg, facts)
        if isinstance(placed, Rejection):
            self.metrics.rejected.labels(placed.reason).inc()
            return placed
        plan = placed.plan
        attempt = Attempt(msg, placed, time.monotonic(), route_of(plan, stage_plans(plan, facts.block_shape[0])))
        self.attempts[msg.wire_id] = attempt
        self.metrics.plans.inc()
        self.metrics.of_node(self.metrics.prefill_dispatched, plan.prefill.node_id).inc()
        self.replicator.note_hits(msg.hashes[: plan.reusable_blocks])
        self.sessions.turn(msg)
        return attempt

    def _place(self, msg: P.Submit, facts: P.ModelFacts) -> Any:
        shape = pipeline_shape(self.cfg, facts, self.cluster, self.scheduler.prefill_cost.fetch_block_s)
        now = time.monotonic()
        t0 = time.perf_counter()
        placed = place(self.scheduler, self.admission, msg.wire_id, msg.hashes, msg.n_tokens,
                       msg.sampling.max_tokens - msg.num_generated, facts.block_tokens, now, pipeline=shape,
                       deadline=now + msg.ttft_budget_s if msg.ttft_budget_s > 0 else float("inf"),
                       evidence=self.costs.evidence(), judge=msg.new_request, rank=rank(msg.sampling),
                       session=msg.sampling.keep_s > 0)
        self.metrics.decision.observe(time.perf_counter() - t0)
        return placed

    def _send(self, node_id: str, msg: P.Msg) -> None:
        assert self.router is not None
        self.router.send(node_id, msg)

    # ------------------------------------------------------------ what frontends report, ending attempts

    def _end(self, a: Attempt, abort: bool, why: str = "") -> None:
        """Release the attempt's booking; with ``abort`` its workers drop it; with ``why`` its
        owner hears that it ended and gives the request another attempt."""
        if self.attempts.pop(a.wire_id, None) is None:
            return
        a.booking.release()
        if abort:
            for node_id in a.nodes:
                self._send(node_id, P.Abort(a.wire_id))
        if why:
            self._send(a.owner, P.AttemptEnded(a.wire_id, P.FailureKind.RETRY.value, why))

    def _prefilled(self, a: Attempt, p: P.Prefilled) -> None:
        """Its frontend says the attempt's prefill is done: the booked prefill work is over."""
        done, plan = p.done, a.plan
        prefill = self.cluster.get(plan.prefill.node_id)
        if done.stages == 1:  # a pipeline's time says nothing of one instance's prefill cost
            self.costs.observe_prefill(done.computed_tokens, done.cached_tokens, done.prefill_s, done.fetched_blocks,
                                       done.fetch_s)
        if plan.stages:
            self.metrics.pipeline_requests.inc()
        elif not plan.colocated:  # a colocated prompt's wall time also waits for decode steps
            self.costs.observe_dispatch(plan, 0.0, p.reserved_s, p.prefilled_s, done.prefill_s + done.fetch_s)
        a.prefilled = True
        a.booking.prefill_finished()
        if a.submit.share_prefix and not plan.stages:  # its prompt's blocks are on this prefill now
            self.index.add(plan.prefill.node_id, "device", a.submit.hashes)
        if prefill is not None:
            self.stats.prefilled(a, done, prefill, p.prefilled_s)
            if done.finished is None and not plan.colocated:  # a colocated one hands nothing off
                self.stats.handed_to_decode(a, done, prefill.info.moved_block_bytes, self.facts.block_tokens)

    def _on_release(self, node: Node, msg: P.Release) -> None:
        now = time.monotonic()
        for p in msg.prefilled:
            a = self.attempts.get(p.wire_id)
            if a is not None and a.owner == node.node_id and not a.prefilled:
                self._prefilled(a, p)
            elif a is None and (claim := self.adoption.claim(p.wire_id, node.node_id)) is not None:
                claim.prefilled = True  # not adopted yet
        for e in msg.ended:
            a = self.attempts.get(e.wire_id)
            if a is None and self.adoption.claim(e.wire_id, node.node_id) is not None:
                self.adoption.forget(e.wire_id)  # ended before it was adopted
            if a is None or a.owner != node.node_id:
                continue
            self.stats.ended(a, e.decoded, e.decode_s, now)
            self._end(a, abort=e.abort)

    # ------------------------------------------------------------ adopting attempts after a start

    def _on_claims(self, node: Node, msg: P.Claims) -> None:
        """A frontend registered again and tells what it drives: adopted, or ended (see ``adoption.py``)."""
        now = time.monotonic()
        for claim in msg.attempts:
            wire_id = claim.submit.wire_id
            if claim.submit.node_id != node.node_id or wire_id in self.attempts:
                continue  # a frontend claims its own; one known here runs on
            if not self.adoption.take(claim, now):
                self._send(node.node_id, P.AttemptEnded(wire_id, P.FailureKind.RETRY.value,
                                                        "the conductor ended this attempt"))
        self._adopt_ready(now)

    def _adopt_ready(self, now: float) -> None:
        """Book the claims whose route's instances have all registered."""
        facts = self.facts
        if facts is None:
            return
        for wire_id, claim in list(self.adoption.claims.items()):
            if self.cluster.get(claim.submit.node_id) is None:  # its frontend is gone
                self.adoption.forget_owner(claim.submit.node_id)
                continue
            plan = adopted_plan(claim, self.cluster, self.scheduler.prefill_cost, self.scheduler.decode_cost,
                                facts.block_tokens, now)
            if plan is None:
                continue
            self.adoption.forget(wire_id)
            if isinstance(plan, str):  # an instance of it restarted: the attempt is lost there
                self._send(claim.submit.node_id, P.AttemptEnded(wire_id, P.FailureKind.RETRY.value, plan))
                continue
            booking = self.scheduler.book(wire_id, plan, rank=rank(claim.submit.sampling))
            if claim.prefilled:
                booking.prefill_finished()
            self.attempts[wire_id] = Attempt(claim.submit, booking, now, claim.route, prefilled=claim.prefilled)
            self.metrics.adopted_attempts.inc()

    def _settle_adoption(self, now: float) -> None:
        """After the window: a claim whose instances did not come back ends; what no frontend
        claimed is dropped where it is held."""
        lost, orphans = self.adoption.settle(now, lambda w: w in self.attempts)
        for claim in lost:
            if claim.route.planned:
                self._send(claim.submit.node_id, P.AttemptEnded(claim.submit.wire_id, P.FailureKind.RETRY.value,
                                                                "its instances did not come back to the conductor"))
        for wire_id, nodes in orphans.items():
            for node_id in nodes:
                self._send(node_id, P.Abort(wire_id))
            self.metrics.reconciliation_aborts.inc(len(nodes))
        if orphans:
            log.warning("dropped %d attempts no frontend claimed", len(orphans))

    def on_node_lost(self, node: Node, why: str) -> None:
        """A node died, stalled or restarted: its attempts end (their owners move them); its
        stores' clients go; a frontend's attempts are dropped everywhere (``FrontendGone``).
        Frontends hear of it with the liveness check that follows."""
        self.scheduler.forget_node(node.node_id)
        if node.role == "store":
            self.replicator.forget(node.endpoints.get("store", ""))
            self.p2p.drop_node(node.node_id)
        if node.role == "frontend":  # its workers drop all it ordered, what it placed alone too
            self.requests_in_flight.pop(node.node_id, None)
            self.adoption.forget_owner(node.node_id)
            for a in [a for a in self.attempts.values() if a.owner == node.node_id]:
                self.metrics.frontend_aborts.inc()
                self._end(a, abort=False)
            for worker in [n for n in self.cluster.nodes.values() if n.role in P.ENGINE_ROLES]:  # draining, stalled too
                self._send(worker.node_id, P.FrontendGone(node.node_id, node.info.instance, node.info.pid))
        else:
            for a in [a for a in self.attempts.values() if node.node_id in a.nodes]:
                self._end(a, abort=True, why=why)

    async def _liveness_loop(self) -> None:
        live = self.cfg.liveness
        period_s = min(0.5, live.dead_after_s / 4, live.stall_after_s / 4)
        while True:  # on the ticks the nodes' heartbeats go on (``ticks.py``): the same wake-up, often
            await asyncio.sleep(until_tick(period_s, period_s / 2))
            try:
                now = time.monotonic()
                self.membership.check(now)
                self._settle_adoption(now)
                self.views.tell_if_changed()  # a node died, drained, stalled or came back
            except Exception:  # the loop that finds failures must not fail itself
                log.exception("liveness check failed")

    # ------------------------------------------------------------ what the workers report

    def _on_register(self, ident: bytes, msg: P.Register, peer: str = "") -> P.Msg:
        reply = self.membership.register(ident, msg, time.monotonic(), peer)
        if isinstance(reply, P.Registered):
            if self.adoption.claims:
                self._adopt_ready(time.monotonic())
            if msg.info.profile is not None and self.costs.seed(msg.role, msg.info.profile):
                self.scheduler.prefill_cost, self.scheduler.decode_cost = self.costs.prefill, self.costs.decode
            asyncio.get_running_loop().call_soon(self.views.tell)  # after the answer to this one
        return reply

    def _on_heartbeat(self, node: Node, msg: P.Heartbeat) -> None:
        self.membership.heartbeat(node, msg.load, time.monotonic())
        for event in msg.blocks:
            self.membership.block_event(node, event)
        if node.role in ("decode", "colocated"):
            self.costs.observe_decode(msg.load.steps)
        elif node.role == "frontend":
            self.requests_in_flight[node.node_id] = msg.load.running + msg.load.waiting
            self._send(node.node_id, self.view())
