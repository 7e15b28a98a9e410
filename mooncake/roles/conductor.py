"""The conductor: cluster membership, global KV index, scheduling, request lifecycle.

Workers connect DEALER sockets to the conductor's ROUTER. A request is planned
by the scheduler, sent to its prefill instance (which ships KV to the chosen
decode instance), and its tokens flow back here into the request's event queue,
which the HTTP layer turns into responses. A worker that falls silent is
declared dead: its blocks leave the index and its requests move elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.api.errors import APIError
from mooncake.blocks import hash_blocks
from mooncake.config import Config
from mooncake.metrics import Metrics
from mooncake.roles.replicator import Replicator
from mooncake.sched.cluster import Cluster, Node, model_facts, registration_problem
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.security import Curve
from mooncake.sched.scheduler import Plan, Rejection, Scheduler

log = logging.getLogger(__name__)


# role -> (endpoints, info keys) a registration must carry for the role to be usable
@dataclass(eq=False)
class RequestState:
    req_id: str
    tokens: list[int]
    sampling: P.Sampling
    cache_salt: str
    arrived: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    plan: Plan | None = None
    cached_tokens: int = 0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    migrations: int = 0
    attempt: int = 0
    first_of_attempt: bool = False  # the current attempt's prefill token has arrived
    early: list = field(default_factory=list)  # decode tokens that overtook it, held back
    done: bool = False

    @property
    def wire_id(self) -> str:
        """The id workers know this attempt by: messages from an earlier attempt match nothing."""
        return f"{self.req_id}#{self.attempt}"


class Conductor:
    def __init__(self, cfg: Config, tokenizer: Any, model_name: str) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = Metrics()
        self.cluster = Cluster()
        self.index = KVIndex()
        self.prefill_cost = PrefillCostModel()
        self.decode_cost = DecodeCostModel()
        self.scheduler = Scheduler(cfg.conductor, self.cluster, self.index, self.prefill_cost, self.decode_cost)
        self.requests: dict[str, RequestState] = {}
        self.attempts: dict[str, RequestState] = {}  # wire id of the current attempt -> request
        self.model_facts: dict[str, Any] = {}  # model_id, block_tokens, max_model_len, eos: from the first worker
        self._tasks: list[asyncio.Task] = []
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir)
        self.replicator = Replicator(cfg.conductor, self.cluster, self.index, self.metrics, self.curve)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        if self.curve is not None:
            self.curve.server(self.sock, self.ctx)
        self.sock.bind(self.cfg.conductor.endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks += [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._liveness_loop())]
        log.info("conductor listening for roles on %s", self.endpoint)
        return self.endpoint

    async def close(self) -> None:
        """After the HTTP drain, requests left have no client: workers drop them, then close."""
        for req in list(self.requests.values()):
            self._finish(req, "abort", outcome="aborted")  # sends the Aborts as tasks
        await asyncio.sleep(0.1)  # let those tasks run and ZeroMQ flush them (LINGER is 0)
        for t in self._tasks:
            t.cancel()
        self.replicator.close()
        self.sock.close(0)
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()

    @property
    def ready(self) -> bool:
        return bool(self.cluster.of_role("prefill")) and bool(self.cluster.of_role("decode"))

    async def _send(self, node: Node, msg: P.Msg) -> None:
        await self.sock.send_multipart([node.ident, *P.encode(msg)])

    # ------------------------------------------------------------ requests

    @property
    def max_model_len(self) -> int:
        return int(self.model_facts.get("max_model_len", 0))

    def submit(self, tokens: list[int], sampling: P.Sampling, cache_salt: str = "") -> RequestState:
        """Plan and dispatch a request; raises APIError when it is refused."""
        if not self.model_facts:
            raise APIError(503, "no worker has registered yet", code="no_workers", retry_after_s=1)
        if not tokens:
            raise APIError(400, "the prompt is empty", param="prompt")
        limit = self.max_model_len
        if len(tokens) >= limit:
            raise APIError(400, f"the prompt has {len(tokens)} tokens; this model's context is {limit} tokens",
                           param="prompt", code="context_length_exceeded")
        vocab = int(self.model_facts.get("vocab_size", 0))
        if vocab and max(tokens) >= vocab:
            raise APIError(400, f"prompt token id {max(tokens)} is outside the vocabulary (size {vocab})",
                           param="prompt")
        if len(self.requests) >= self.cfg.conductor.max_requests:
            self.metrics.rejected.labels("overloaded").inc()
            raise APIError(503, f"{len(self.requests)} requests in flight; try again later", code="overloaded",
                           retry_after_s=1)
        sampling.max_tokens = min(sampling.max_tokens, limit - len(tokens))
        req = RequestState(f"req-{uuid.uuid4().hex[:16]}", tokens, sampling, cache_salt, time.monotonic())
        self._dispatch(req)
        self.requests[req.req_id] = req
        return req

    def _hashes(self, tokens: list[int], salt: str) -> list[bytes]:
        return hash_blocks(tokens, self.model_facts["block_tokens"], self.model_facts["model_id"], salt or None)

    def _dispatch(self, req: RequestState) -> None:
        """Plan ``req`` (prompt + tokens generated so far) and send it to its prefill instance."""
        tokens = req.tokens + req.generated
        hashes = self._hashes(tokens, req.cache_salt)
        t0 = time.perf_counter()
        waiting = sum(len(n.work) for n in self.cluster.of_role("prefill"))
        plan = self.scheduler.plan(hashes, len(tokens), req.sampling.max_tokens - len(req.generated),
                                   self.model_facts["block_tokens"], time.monotonic(), waiting)
        self.metrics.decision.observe(time.perf_counter() - t0)
        if isinstance(plan, Rejection):
            self.metrics.rejected.labels(plan.reason).inc()
            raise APIError(plan.status, plan.message, code=plan.reason, retry_after_s=plan.retry_after_s)
        req.plan = plan
        req.attempt += 1
        req.first_of_attempt, req.early = False, []
        self.attempts[req.wire_id] = req
        if not req.generated:
            self.metrics.prefix_queries.inc(len(tokens))
        plan.prefill.work[req.wire_id] = plan.est_prefill_s
        batch = plan.decode.running_at(time.monotonic() + plan.est_ttft_s) + 1
        plan.decode.assign(req.wire_id, self.scheduler.expected_end(
            time.monotonic(), plan.est_ttft_s, req.sampling.max_tokens, batch))
        self.metrics.prefill_dispatched.labels(plan.prefill.node_id).inc()
        stores = [n for n in self.cluster.of_role("store") if n.name == plan.prefill.name] or \
            self.cluster.of_role("store")
        store_ep = min(stores, key=lambda s: s.node_id).endpoints["store"] if (stores and self.cfg.conductor.use_store) else ""
        msg = P.PrefillRequest(
            req_id=req.wire_id, tokens=req.tokens, hashes=hashes, sampling=req.sampling,
            decode_node=plan.decode.node_id, decode_endpoint=plan.decode.endpoints["kv"], fetch=plan.fetch,
            store_endpoint=store_ep, generated=req.generated, cache_salt=req.cache_salt)
        asyncio.get_running_loop().create_task(self._send(plan.prefill, msg))
        self.replicator.note_hits(hashes[: plan.reusable_blocks])

    def abort(self, req_id: str) -> None:
        """Free everything the request holds, everywhere (client gone, stop string hit)."""
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, "abort", outcome="aborted")

    def _release(self, req: RequestState) -> None:
        if req.plan is not None:
            req.plan.prefill.work.pop(req.wire_id, None)
            req.plan.decode.unassign(req.wire_id)
            self.attempts.pop(req.wire_id, None)

    def _abort_attempt(self, req: RequestState) -> None:
        """Tell the live workers of the current attempt to drop it."""
        if req.plan is None:
            return
        loop = asyncio.get_running_loop()
        for node in (req.plan.prefill, req.plan.decode):
            if self.cluster.get(node.node_id) is node:
                loop.create_task(self._send(node, P.Abort(req.wire_id)))

    def _finish(self, req: RequestState, reason: str, error: str = "", outcome: str = "") -> None:
        """End a request: tell its workers to drop it (unless they ended it), free its slots."""
        if req.done:
            return
        req.done = True
        if reason not in ("stop", "length"):
            self._abort_attempt(req)
        self._release(req)
        self.requests.pop(req.req_id, None)
        self.metrics.e2e.observe(time.monotonic() - req.arrived)
        self.metrics.requests.labels(outcome or ("error" if error else "ok")).inc()
        req.events.put_nowait(("done", reason, error))

    # ------------------------------------------------------------ messages from roles

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg, _ = P.decode(frames[1:])
            except P.ProtocolError as e:
                log.warning("dropping malformed message from %r: %s", ident, e)
                continue
            try:
                await self._handle(ident, msg)
            except Exception:  # one bad message must never stop the conductor
                log.exception("error handling %s", type(msg).__name__)

    async def _handle(self, ident: bytes, msg: P.Msg) -> None:
        now = time.monotonic()
        if isinstance(msg, P.Register):
            await self._on_register(ident, msg, now)
            return
        node_id = getattr(msg, "node_id", None) or ident.decode(errors="replace")
        node = self.cluster.get(node_id)
        if node is None or node.ident != ident:
            if isinstance(msg, P.Heartbeat):
                await self.sock.send_multipart([ident, *P.encode(P.Reregister())])
            return
        node.last_seen = now
        if isinstance(msg, P.Heartbeat):
            self._on_heartbeat(node, msg.load)
        elif isinstance(msg, P.Leave):
            self.cluster.set_draining(node.node_id)
            log.info("%s %s is draining: no new work", node.role, node.node_id)
        elif isinstance(msg, P.BlockEvent):
            if msg.kind == "stored":
                self.index.add(node.node_id, msg.tier, msg.hashes)
            else:
                self.index.remove(node.node_id, msg.hashes)
            self.metrics.index_blocks.set(len(self.index))
        elif isinstance(msg, P.PrefillDone):
            self._on_prefill_done(node, msg, now)
        elif isinstance(msg, P.TokenEvent):
            self._on_tokens(node, msg, now)
        elif isinstance(msg, P.Failed):
            self._on_failed(node, msg)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, node_id)

    async def _on_register(self, ident: bytes, msg: P.Register, now: float) -> None:
        info = msg.info
        refusal = registration_problem(msg.role, msg.node_id, msg.endpoints, info, self.model_facts)
        if refusal is not None:
            log.error("refusing registration of %r as %r: %s", msg.node_id, msg.role, refusal.message)
            await self.sock.send_multipart([ident, *P.encode(refusal)])
            return
        if msg.role in ("prefill", "decode") and not self.model_facts:
            self.model_facts = model_facts(info)
        old = self.cluster.get(msg.node_id)
        restarted = old is not None and old.info.get("pid") != info.get("pid")
        node, new = self.cluster.upsert(msg.node_id, msg.role, str(info.get("node_name", "")), ident,
                                        msg.endpoints, info, now)
        if restarted:  # a new process under the same id: what the old one held is gone
            self.index.drop_node(node.node_id)
        if old is not None:  # requests planned on the old record: moved (restart) or re-pointed
            for req in list(self.requests.values()):
                if req.done or req.plan is None or old not in (req.plan.prefill, req.plan.decode):
                    continue
                if restarted:
                    self._migrate(req, f"{msg.role} instance {msg.node_id} restarted")
                else:
                    req.plan.prefill = node if req.plan.prefill is old else req.plan.prefill
                    req.plan.decode = node if req.plan.decode is old else req.plan.decode
        self.metrics.nodes.labels(msg.role).set(len(self.cluster.of_role(msg.role)))
        if new or restarted:
            log.info("%s %s registered%s", msg.role, msg.node_id, " (restarted)" if restarted else "")
        await self.sock.send_multipart([ident, *P.encode(P.Registered(msg.node_id, self.cfg.conductor.heartbeat_s))])

    def _on_heartbeat(self, node: Node, load: dict[str, Any]) -> None:
        node.load = load
        if node.role == "decode":
            for batch, seconds in load.get("steps", []):
                self.decode_cost.observe(int(batch), float(seconds))
        if node.role in ("prefill", "decode"):
            self.metrics.running.labels(node.node_id).set(load.get("running", 0))
            self.metrics.waiting.labels(node.node_id).set(load.get("waiting", 0))
        for tier, st in load.get("tiers", {}).items():
            self.metrics.tier_used.labels(node.node_id, tier).set(st.get("used_bytes", 0))
            self.metrics.tier_hits.labels(node.node_id, tier).set(st.get("hits", 0))
            self.metrics.tier_evictions.labels(node.node_id, tier).set(st.get("evictions", 0))

    def _on_prefill_done(self, node: Node, msg: P.PrefillDone, now: float) -> None:
        self.prefill_cost.observe(msg.computed_tokens, msg.cached_tokens, msg.prefill_s)
        self.prefill_cost.observe_fetch(msg.fetched_blocks, msg.fetch_s)
        node.work.pop(msg.req_id, None)
        req = self.attempts.get(msg.req_id)
        if req is None or req.done or req.plan is None or req.plan.prefill is not node:
            return
        block_bytes = int(node.info.get("block_bytes", 0))
        bt = self.model_facts["block_tokens"]
        n_tokens = len(req.tokens) + len(req.generated)
        self.metrics.kv_bytes.labels("store_to_prefill").inc(msg.fetched_blocks * block_bytes)
        if not msg.finished:
            self.metrics.kv_bytes.labels("prefill_to_decode").inc(-(-n_tokens // bt) * block_bytes)
        if not req.generated:
            req.cached_tokens = msg.cached_tokens
            self.metrics.prefix_hits.inc(msg.cached_tokens)
            self.metrics.ttft.observe(now - req.arrived)
            self.metrics.queue_time.observe(max(0.0, now - req.arrived - msg.prefill_s - msg.fetch_s))
            req.first_token_at = now
        req.last_token_at = now
        req.first_of_attempt = True
        if msg.finished and self.cluster.get(req.plan.decode.node_id) is req.plan.decode:
            # Done at its first token: the decode may hold streamed blocks that no final part completes.
            asyncio.get_running_loop().create_task(self._send(req.plan.decode, P.Abort(req.wire_id)))
        self._emit(req, [msg.first_token], msg.finished)
        for early in req.early:  # decode tokens sent on a faster path than the prefill's report
            self._on_tokens(node if req.plan is None else req.plan.decode, early, now)
        req.early = []

    def _on_tokens(self, node: Node, msg: P.TokenEvent, now: float) -> None:
        req = self.attempts.get(msg.req_id)
        if req is None or req.done or req.plan is None or req.plan.decode is not node:
            return  # late tokens of an attempt that moved or ended
        if not req.first_of_attempt:
            req.early.append(msg)
            return
        if msg.error:
            self._on_failed(node, P.Failed(msg.req_id, node.node_id, msg.error))
            return
        if msg.tokens and req.last_token_at:
            self.metrics.itl.observe((now - req.last_token_at) / len(msg.tokens))
        req.last_token_at = now
        self._emit(req, msg.tokens, msg.finished)

    def _emit(self, req: RequestState, tokens: list[int], finished: str) -> None:
        req.generated.extend(tokens)
        if tokens:
            req.events.put_nowait(("tokens", tokens))
        if finished:
            self._finish(req, finished)

    def _on_failed(self, node: Node, msg: P.Failed) -> None:
        req = self.attempts.get(msg.req_id)
        if req is None or req.done or req.plan is None or node not in (req.plan.prefill, req.plan.decode):
            return  # a failure of an attempt that already moved or ended
        log.warning("%s failed %s: %s", node.node_id, msg.req_id, msg.message)
        self._migrate(req, msg.message, retry=msg.retry)

    def _migrate(self, req: RequestState, why: str, retry: bool = True) -> None:
        """Re-dispatch a request whose worker failed or died (prompt + tokens so far)."""
        self._abort_attempt(req)
        self._release(req)
        if not retry or req.migrations >= self.cfg.conductor.max_migrations:
            self._finish(req, "error", f"request failed: {why}")
            return
        req.migrations += 1
        self.metrics.migrations.inc()
        try:
            self._dispatch(req)
        except APIError as e:
            self._finish(req, "error", f"request failed: {why}; no instance to move it to ({e.message})")

    # ------------------------------------------------------------ liveness

    async def _liveness_loop(self) -> None:
        cfg = self.cfg.conductor
        while True:
            await asyncio.sleep(min(0.5, cfg.dead_after_s / 4))
            now = time.monotonic()
            for node in self.cluster.silent_since(now - cfg.dead_after_s):
                self._declare_dead(node)
            for req in list(self.requests.values()):
                last = req.last_token_at or req.arrived
                if now - last > cfg.request_timeout_s:
                    self._finish(req, "error", f"no progress for {cfg.request_timeout_s:.0f}s")

    def _declare_dead(self, node: Node) -> None:
        log.warning("%s %s is silent: declared dead", node.role, node.node_id)
        self.cluster.remove(node.node_id)
        self.index.drop_node(node.node_id)
        self.metrics.nodes.labels(node.role).set(len(self.cluster.of_role(node.role)))
        self.replicator.forget(node.endpoints.get("store", ""))
        for req in list(self.requests.values()):
            if req.plan is not None and node in (req.plan.prefill, req.plan.decode) and not req.done:
                self._migrate(req, f"{node.role} instance {node.node_id} died")
