"""Membership and liveness: who may join, who is alive, who is stuck, who is leaving.

A node joins with ``Register`` and stays alive by heartbeating. A node silent for
``dead_after_s`` is dead; an engine node that reports work pending but no engine
progress for ``stall_after_s`` is stalled (its event loop runs, its engine does
not): both lose their requests, which move elsewhere. A stalled node that
progresses again takes work again. ``Leave`` marks a node draining: it finishes
what it has and gets nothing new.

Authorization: under CURVE each registration comes with its peer key
(``KIND:key``): prefill and decode must hold the worker key, stores the store key,
frontends a frontend key; a node id held by a live node cannot be taken over under
another key, nor by another process start (``NodeInfo.instance``: workers share one
key) — refused as ``node_id_taken``, which the newcomer retries (``roles/conductor_link.py``)
until the old one has left (``Leave``: draining) or is declared dead. The model is
what the conductor's own copy says (``ExpectedModel``), not what the first
registrant claims.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Mapping

from mooncake import protocol as P
from mooncake.conductor.expected_model import ExpectedModel
from mooncake.config import LivenessConfig
from mooncake.metrics import Metrics
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.kv_index import KVIndex
from mooncake.security import ROLE_KIND, kind_of

if TYPE_CHECKING:
    from mooncake.conductor.adoption import Adoption
    from mooncake.conductor.attempt import Attempt

log = logging.getLogger(__name__)

_ENDPOINTS = {"prefill": (), "decode": ("kv",), "colocated": (), "store": ("store",), "frontend": ("tokens",)}  # what each role must advertise


def registration_problem(msg: P.Register, facts: P.ModelFacts | None,
                         expected: ExpectedModel | None = None) -> P.Error | None:
    """Why a registration is refused (the Error to answer with), or None to accept it."""
    needs = _ENDPOINTS.get(msg.role)
    if needs is None or not msg.node_id:
        return P.Error(f"cannot register {msg.node_id!r} as role {msg.role!r}", "bad_register")
    missing = [k for k in needs if not msg.endpoints.get(k)]
    if msg.role in P.ENGINE_ROLES and msg.info.model is None:
        missing.append("info.model")
    if missing:
        return P.Error(f"cannot register role {msg.role!r} (missing: {missing})", "bad_register")
    model = msg.info.model
    problem = expected.problem(model) if model is not None and expected is not None else None
    if problem is not None:
        return P.Error(f"model mismatch: {problem}", "model_mismatch")
    if model is not None and facts is not None and \
            (model.model_id, model.block_tokens) != (facts.model_id, facts.block_tokens):
        return P.Error(f"model mismatch: it serves {model.model_id} in blocks of {model.block_tokens}, "
                       f"the cluster serves {facts.model_id} in blocks of {facts.block_tokens}", "model_mismatch")
    return None


class Membership:
    def __init__(self, cfg: LivenessConfig, cluster: Cluster, index: KVIndex, metrics: Metrics,
                 on_lost: Callable[[Node, str], None], attempts: Mapping[str, Attempt], adoption: Adoption,
                 expected: ExpectedModel | None = None, keys_required: bool = False) -> None:
        """``on_lost(node, why)``: the node's requests must move (it died, stalled or restarted).
        ``expected``: the conductor's own model (None: the first engine's facts rule);
        ``keys_required``: registrations must come with a peer key of the role's kind (CURVE)."""
        self.cfg = cfg
        self.cluster = cluster
        self.index = index
        self.metrics = metrics
        self.on_lost = on_lost
        self.attempts = attempts  # wire id -> the attempt: what a registering worker may keep
        self.adoption = adoption  # ... and, just after the conductor started, what a frontend may still claim
        self.expected = expected
        self.keys_required = keys_required
        self.facts: P.ModelFacts | None = None  # what the cluster serves: the first engine matching ``expected``
        self.peers: dict[str, str] = {}  # node id -> the peer key it registered with
        self._kept_tenants: dict[str, set[str]] = {}  # node id -> the tenants it last said keep blocks

    def register(self, ident: bytes, msg: P.Register, now: float, peer: str = "") -> P.Msg:
        """Admit or refuse a node (``peer``: its CURVE key, ``KIND:key``); returns the answer to send it."""
        refusal = self._unauthorized(msg, peer) or registration_problem(msg, self.facts, self.expected)
        if refusal is not None:
            log.error("refusing registration of %r as %r: %s", msg.node_id, msg.role, refusal.message)
            return refusal
        if msg.info.model is not None and self.facts is None:
            self.facts = msg.info.model
        node = Node(msg.node_id, msg.role, ident, dict(msg.endpoints), msg.info, now, progress_at=now, peer=peer)
        old = self.cluster.upsert(node)
        self.peers[msg.node_id] = peer
        restarted = old is not None and (old.info.pid, old.info.instance) != (msg.info.pid, msg.info.instance)
        if restarted:  # a new process under the same id: what the old one held is gone
            self.index.drop_node(node.node_id)
        if old is not None:
            node.load, node.draining = old.load, old.draining and not restarted
            self.cluster.reindex()
            if restarted:
                self.on_lost(old, f"{msg.role} instance {msg.node_id} restarted")
        self._count(msg.role)
        if old is None or restarted:
            log.info("%s %s registered%s", msg.role, msg.node_id, " (restarted)" if restarted else "")
        return P.Registered(msg.node_id, self.cfg.heartbeat_s, self._keep(msg, now))

    def _keep(self, msg: P.Register, now: float) -> list[str]:
        """Reconciliation: of the requests a registering worker holds (after a conductor restart,
        or back from being declared dead), those whose attempt still runs there, and those a
        frontend may still claim (just after the conductor started, or placed by a frontend
        alone: ``adoption.py``); it drops the rest, so no reservation waits for a timeout."""
        alone = set(msg.fallback)
        keep = [w for w in msg.holding if (a := self.attempts.get(w)) is not None and msg.node_id in a.nodes
                or a is None and self.adoption.hold(w, msg.node_id, now, fallback=w in alone)]
        if len(keep) < len(msg.holding):
            self.metrics.reconciliation_aborts.inc(len(msg.holding) - len(keep))
            log.warning("%s %s held %d requests this conductor does not know there: it drops them",
                        msg.role, msg.node_id, len(msg.holding) - len(keep))
        return keep

    def _unauthorized(self, msg: P.Register, peer: str) -> P.Error | None:
        if self.keys_required and kind_of(peer) != ROLE_KIND.get(msg.role):
            self.metrics.refused_registrations.labels("key_kind").inc()
            return P.Error(f"a {kind_of(peer) or 'keyless'} key may not register as {msg.role!r}", "unauthorized")
        taken, old = self.peers.get(msg.node_id), self.cluster.get(msg.node_id)
        if taken is not None and taken != peer and old is not None:
            self.metrics.refused_registrations.labels("node_id_taken").inc()
            return P.Error(f"node id {msg.node_id!r} is registered under another key", "unauthorized")
        if self.keys_required and old is not None and not old.draining and \
                (old.info.instance, old.info.pid) != (msg.info.instance, msg.info.pid):
            self.metrics.refused_registrations.labels("node_id_taken").inc()
            return P.Error(f"node id {msg.node_id!r} is held by another live process; it may register once "
                           f"that one leaves or is declared dead", "node_id_taken")
        return None

    def heartbeat(self, node: Node, load: P.Load, now: float) -> None:
        progressed = load.progress != node.load.progress
        if progressed or not node.load.pending:
            node.progress_at = now  # it progressed, or it was idle until now
        node.load = load
        if node.stalled and progressed:
            log.warning("%s %s progresses again: takes work again", node.role, node.node_id)
            node.stalled = False
            self.cluster.reindex()
        m = self.metrics
        if node.role in P.ENGINE_ROLES:
            m.of_node(m.running, node.node_id).set(load.running)
            m.of_node(m.waiting, node.node_id).set(load.waiting)
            m.report(m.writes_dropped, node.node_id, (), load.writes_dropped)
        for name, total in load.speculative.items():
            if name in m.speculative:
                m.report(m.speculative[name], node.node_id, (), total)
        for segment, count in load.evicted.items():
            m.report(m.device_evictions, node.node_id, (segment,), count)
        for reason, count in load.kv_rejected.items():
            m.report(m.kv_rejected, node.node_id, (reason,), count)
        for message, count in load.stale_terms.items():  # what it refused from a stale leader (term_fence.py)
            m.report(m.stale_term_refused, node.node_id, (message,), count)
        for tenant in {*load.kept_by_tenant, *self._kept_tenants.get(node.node_id, ())}:  # none kept now: 0
            m.of_node(m.tenant_kept_blocks, node.node_id, tenant).set(load.kept_by_tenant.get(tenant, 0))
        self._kept_tenants[node.node_id] = set(load.kept_by_tenant)
        for outcome, by_tenant in (("stored", load.written_by_tenant), ("dropped", load.dropped_by_tenant)):
            for tenant, total in by_tenant.items():
                m.report(m.tenant_store_bytes, node.node_id, (tenant, outcome), total)
        for tier, st in load.tiers.items():
            m.of_node(m.tier_used, node.node_id, tier).set(st.used_bytes)
            m.report(m.tier_hits, node.node_id, (tier,), st.hits)
            m.report(m.tier_evictions, node.node_id, (tier,), st.evictions)
            m.report(m.tier_flex_evictions, node.node_id, (tier,), st.flex_evictions)

    def block_event(self, node: Node, msg: P.BlockEvent) -> None:
        """The index follows what a node holds."""
        if msg.kind == "stored":
            self.index.add(node.node_id, msg.tier, msg.hashes)
        else:
            self.index.remove(node.node_id, msg.hashes)

    def leave(self, node: Node) -> None:
        node.draining = True
        self.cluster.reindex()
        log.info("%s %s is draining: no new work", node.role, node.node_id)

    def check(self, now: float) -> None:
        """Declare dead the silent, and stalled the stuck (called periodically)."""
        for node in self.cluster.silent_since(now - self.cfg.dead_after_s):
            log.warning("%s %s is silent: declared dead", node.role, node.node_id)
            self.cluster.remove(node.node_id)
            self.metrics.forget_node(node.node_id)
            self.peers.pop(node.node_id, None)
            self._kept_tenants.pop(node.node_id, None)
            self.index.drop_node(node.node_id)
            self._count(node.role)
            self.on_lost(node, f"{node.role} instance {node.node_id} died")
        for node in list(self.cluster.nodes.values()):
            if not node.stalled and node.load.pending and now - node.progress_at > self.cfg.stall_after_s:
                log.error("%s %s has had work but made no engine progress for %.0fs: declared unhealthy",
                          node.role, node.node_id, now - node.progress_at)
                node.stalled = True
                self.cluster.reindex()
                self._count(node.role)
                self.on_lost(node, f"{node.role} instance {node.node_id} is stalled")

    def largest_pool(self) -> int:
        """The most KV blocks a request can have on one instance: the smaller of the largest
        prefill's and the largest decode's pool, or a colocated instance's (0 when none takes work)."""
        def largest(role: str) -> int:
            return max((n.info.num_blocks for n in self.cluster.of_role(role)), default=0)
        return max(min(largest("prefill"), largest("decode")), largest("colocated"))

    def _count(self, role: str) -> None:
        self.metrics.nodes.labels(role).set(len(self.cluster.of_role(role)))
