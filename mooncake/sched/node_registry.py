"""The conductor's registry of nodes: who is there, how to reach them, what they last reported.

A ``Node`` is a registry record; what the scheduler predicts and books about a
node lives in the scheduler (``mooncake.sched.booking``), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake.protocol import Load, NodeInfo


@dataclass(eq=False)
class Node:
    node_id: str
    role: str  # "prefill" | "decode" | "colocated" | "store" | "frontend"
    ident: bytes  # ZeroMQ routing id on the conductor's ROUTER
    endpoints: dict[str, str]
    info: NodeInfo
    last_seen: float
    load: Load = field(default_factory=Load)
    progress_at: float = 0.0  # when ``load.progress`` last advanced (or the work began)
    draining: bool = False  # leaving: finishes what it has, gets nothing new
    stalled: bool = False  # has work but its engine stopped progressing: gets nothing new
    peer: str = ""  # the CURVE key it registered under (``KIND:key``; "" without CURVE): its messages must come under it

    @property
    def name(self) -> str:
        """Machine name: nodes with the same name are local to each other."""
        return self.info.node_name

    @property
    def takes_work(self) -> bool:
        return not (self.draining or self.stalled)


class Cluster:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._by_role: dict[str, list[Node]] = {}  # rebuilt on membership changes (rare)
        self.version = 0  # bumped by every change of membership or of who takes work

    def reindex(self) -> None:
        """Call after changing a node's ``draining`` or ``stalled``."""
        self._by_role = {}
        for n in self.nodes.values():
            if n.takes_work:
                self._by_role.setdefault(n.role, []).append(n)
        self.version += 1

    def upsert(self, node: Node) -> Node | None:
        """Register (or re-register) a node; returns the record it replaces, if any."""
        old = self.nodes.get(node.node_id)
        self.nodes[node.node_id] = node
        self.reindex()
        return old

    def get(self, node_id: str) -> Node | None:
        return self.nodes.get(node_id)

    def of_role(self, role: str) -> list[Node]:
        """The live nodes of a role that take new work (a shared list: read it, do not change it)."""
        return self._by_role.get(role, [])

    def remove(self, node_id: str) -> Node | None:
        node = self.nodes.pop(node_id, None)
        self.reindex()
        return node

    def silent_since(self, cutoff: float) -> list[Node]:
        return [n for n in self.nodes.values() if n.last_seen < cutoff]
