"""The conductor's view of the cluster: registered nodes, liveness, assigned work."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from mooncake.protocol import Error

# What a role must present to join: (endpoints, info keys).
_NEEDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prefill": ((), ("model_id", "block_tokens", "max_model_len")),
    "decode": (("kv",), ("model_id", "block_tokens", "max_model_len")),
    "store": (("store",), ()),
}
_FACTS = ("model_id", "block_tokens", "max_model_len", "vocab_size")


def model_facts(info: dict[str, Any]) -> dict[str, Any]:
    """The model facts an engine role reports: what the cluster serves."""
    return {k: info[k] for k in _FACTS if k in info}


def registration_problem(role: str, node_id: str, endpoints: dict[str, str], info: dict[str, Any],
                         cluster_facts: dict[str, Any]) -> Error | None:
    """Why a registration is refused (an Error to answer with), or None to accept it."""
    needs = _NEEDS.get(role)
    if needs is None or not node_id:
        return Error(f"cannot register {node_id!r} as role {role!r}", "bad_register")
    missing = [k for k in needs[0] if not endpoints.get(k)] + [k for k in needs[1] if k not in info]
    if missing:
        return Error(f"cannot register role {role!r} (missing: {missing})", "bad_register")
    if role in ("prefill", "decode") and cluster_facts:
        facts = model_facts(info)
        if facts["model_id"] != cluster_facts["model_id"] or facts["block_tokens"] != cluster_facts["block_tokens"]:
            return Error(f"model mismatch: it serves {facts}, the cluster serves {cluster_facts}", "model_mismatch")
    return None


@dataclass(eq=False)
class Node:
    node_id: str
    role: str  # "prefill" | "decode" | "store"
    name: str  # machine name: nodes with the same name are local to each other
    ident: bytes  # ZeroMQ routing id on the conductor's ROUTER
    endpoints: dict[str, str]
    info: dict[str, Any]
    last_seen: float
    load: dict[str, Any] = field(default_factory=dict)
    # prefill: request -> estimated seconds of work still queued or running
    work: dict[str, float] = field(default_factory=dict)
    # decode: request -> expected end time; ``ends`` is the same values kept sorted
    assigned: dict[str, float] = field(default_factory=dict)
    ends: list[float] = field(default_factory=list)
    draining: bool = False

    @property
    def queue_s(self) -> float:
        return sum(self.work.values())

    def assign(self, req_id: str, expected_end: float) -> None:
        self.assigned[req_id] = expected_end
        bisect.insort(self.ends, expected_end)

    def unassign(self, req_id: str) -> None:
        end = self.assigned.pop(req_id, None)
        if end is not None:
            i = bisect.bisect_left(self.ends, end)
            if i < len(self.ends) and self.ends[i] == end:
                del self.ends[i]

    def running_at(self, t: float) -> int:
        """Assigned requests expected to still be decoding at time ``t``."""
        return len(self.ends) - bisect.bisect_right(self.ends, t)


class Cluster:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._by_role: dict[str, list[Node]] = {}  # rebuilt on membership changes (rare)

    def _reindex(self) -> None:
        self._by_role = {}
        for n in self.nodes.values():
            if not n.draining:
                self._by_role.setdefault(n.role, []).append(n)

    def set_draining(self, node_id: str) -> None:
        """The node finishes what it has but gets nothing new (it is shutting down)."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.draining = True
            self._reindex()

    def upsert(self, node_id: str, role: str, name: str, ident: bytes, endpoints: dict[str, str],
               info: dict[str, Any], now: float) -> tuple[Node, bool]:
        """Register (or re-register) a node; returns (node, is_new)."""
        old = self.nodes.get(node_id)
        node = Node(node_id, role, name, ident, dict(endpoints), dict(info), now)
        if old is not None:  # keep the conductor's bookkeeping across a re-registration
            node.work, node.assigned, node.ends = old.work, old.assigned, old.ends
        self.nodes[node_id] = node
        self._reindex()
        return node, old is None

    def get(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)

    def of_role(self, role: str) -> list[Node]:
        """The live nodes of a role that take new work (a shared list: read it, do not change it)."""
        return self._by_role.get(role, [])

    def remove(self, node_id: str) -> Node | None:
        node = self.nodes.pop(node_id, None)
        self._reindex()
        return node

    def silent_since(self, cutoff: float) -> list[Node]:
        return [n for n in self.nodes.values() if n.last_seen < cutoff]
