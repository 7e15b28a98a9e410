"""What frontends are told of the cluster (``ClusterView``), and what ``GET /cluster`` shows (on any
frontend, which asks the conductor): the nodes with their endpoints, last reported load and the
scheduler's bookings, the cost models' estimates, the predictions' record, and each tenant's share."""

from __future__ import annotations

import time
from typing import Any, Iterable, Protocol

import msgspec

from mooncake import protocol as P
from mooncake.conductor.attempt import Attempt, worker_ref
from mooncake.conductor.router import Router
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import CostModels
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.predictions import Predictions
from mooncake.sched.scheduler import Scheduler

RETELL_S = 10.0  # frontends are told the view at least this often


class ConductorState(Protocol):
    """What the views read of the conductor (``conductor.Conductor``)."""

    name: str
    model_name: str
    leader_term: int
    cluster: Cluster
    index: KVIndex
    scheduler: Scheduler
    costs: CostModels
    predictions: Predictions
    router: Router
    attempts: dict[str, Attempt]
    requests_in_flight: dict[str, int]

    @property
    def ready(self) -> bool: ...

    @property
    def facts(self) -> P.ModelFacts | None: ...


def cluster_view(c: ConductorState, snapshot: bool = False) -> P.ClusterView:
    """Who leads, what the cluster serves, whether it can, its workers (for a frontend's fallback);
    with ``snapshot``, ``GET /cluster``'s."""
    nodes = {role: len(c.cluster.of_role(role)) for role in (*P.ENGINE_ROLES, "store", "frontend")}
    workers = [worker_ref(n) for role in P.ENGINE_ROLES for n in c.cluster.of_role(role) if n.endpoints.get("orders")]
    return P.ClusterView(c.name, c.facts, c.ready, nodes, cluster_snapshot(c) if snapshot else {}, workers)


class FrontendViews:
    """The view frontends are told (``cluster_view``, no snapshot): the same until the membership
    changes, so built once per change; told to every frontend on a change, and every
    ``RETELL_S`` (a busy frontend sends no heartbeat for the conductor to answer with it, and a
    message to a peer past its high-water mark is dropped)."""

    def __init__(self, c: ConductorState) -> None:
        self.c = c
        self._view: tuple[Any, Any] = (None, None)  # (cluster version, facts) -> the view
        self._told = (-1, 0.0)  # the cluster's version frontends were last told of, and when

    def current(self) -> P.ClusterView:
        key = (self.c.cluster.version, self.c.facts)
        if self._view[0] != key:
            self._view = (key, cluster_view(self.c))
        return self._view[1]

    def tell(self) -> None:
        self._told = (self.c.cluster.version, time.monotonic())
        for node in self.c.cluster.of_role("frontend"):
            self.c.router.send(node.node_id, self.current())

    def tell_if_changed(self) -> None:
        version, at = self._told
        if self.c.cluster.version != version or time.monotonic() - at >= RETELL_S:
            self.tell()


def cluster_snapshot(c: ConductorState) -> dict:
    s, costs, facts = c.scheduler, c.costs, c.facts
    pw, dw = costs.prefill.weights, costs.decode.weights
    return {"model": c.model_name, "leader": c.name,
            "leader_term": c.leader_term,  # its campaign key's etcd revision; 0: no etcd
            "index_blocks": len(c.index), "attempts": len(c.attempts),
            "requests": sum(c.requests_in_flight.values()),
            "block_tokens": facts.block_tokens if facts else 0,
            "estimates": {"prefill_1k_tokens_s": costs.prefill.predict(1000, 0),
                          "decode_step_batch_8_s": costs.decode.predict(8, 8 * 1024),  # 1k tokens each
                          "prefill_fixed_s": pw[0], "prefill_per_token_s": pw[1] / 1000,
                          "prefill_per_pair_s": pw[2] / 1e6, "decode_step_s": dw[0], "decode_per_seq_s": dw[1],
                          "decode_per_kv_token_s": dw[2] / 1000,
                          "fetch_block_s": costs.prefill.fetch_block_s,  # measured: the DRAM and default figure
                          "fetch_block_s_by_tier": s.fetch_costs.per_block_s(costs.prefill.fetch_block_s),
                          "dispatch_s": costs.prefill.dispatch.value, "transit_s": costs.prefill.transit.value,
                          "profiled": sorted(costs.profiled)},
            "predictions": c.predictions.summary(),
            "frontends": [n.node_id for n in c.cluster.nodes.values() if n.role == "frontend"],
            "tenants": tenant_shares(c.cluster.nodes.values(), [a.submit.sampling.tenant for a in c.attempts.values()]),
            "nodes": [{"node_id": n.node_id, "role": n.role, "name": n.name, "pid": n.info.pid,
                       "instance": n.info.instance, "endpoints": n.endpoints,
                       "num_blocks": n.info.num_blocks, "block_bytes": n.info.block_bytes,
                       "kv_block_bytes": n.info.moved_block_bytes, "step_tokens": n.info.step_tokens,
                       "step_target_ms": n.info.step_target_ms,
                       "cpus": n.info.cpus, "threads": n.info.threads, "machine": n.info.machine,
                       "load": msgspec.to_builtins(n.load), "queued": s.queued(n.node_id),
                       "assigned": s.assigned(n.node_id), "draining": n.draining, "stalled": n.stalled,
                       "blocks_indexed": c.index.blocks_of(n.node_id)}
                      for n in c.cluster.nodes.values()]}


def tenant_shares(nodes: Iterable[Node], in_flight: list[str]) -> dict[str, dict[str, float]]:
    """Per tenant (its id, "" without API keys): ``attempts``, its requests' attempts placed and not
    ended (``in_flight``: each one's tenant), and ``share``, their part of all of them;
    ``kept_blocks``, the blocks its sessions keep in the engines' prefix caches and the stores, and
    ``store_bytes``, what it wrote to the stores since they started, summed over the nodes' last
    reports (each node's own are in its ``load``: ``kept_by_tenant``, ``written_by_tenant``)."""
    out: dict[str, dict[str, float]] = {}

    def of(tenant: str) -> dict[str, float]:
        return out.setdefault(tenant, {"attempts": 0, "share": 0.0, "kept_blocks": 0, "store_bytes": 0})

    for tenant in in_flight:
        of(tenant)["attempts"] += 1
    for node in nodes:
        for tenant, kept in node.load.kept_by_tenant.items():
            of(tenant)["kept_blocks"] += kept
        for tenant, written in node.load.written_by_tenant.items():
            of(tenant)["store_bytes"] += written
    for share in out.values():
        share["share"] = round(share["attempts"] / len(in_flight), 3) if in_flight else 0.0
    return out
