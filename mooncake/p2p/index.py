"""The conductor's P2P index: which store holds which verified chunks of which object.

Stores announce what they hold (``Publish`` for a whole object, ``Have`` per verified
chunk as a fetch goes); fetchers ask ``Locate`` for the manifest and the live holders.
A holder is listed only while its store is registered: a dead store drops out with its
registration (``drop_node``), and re-announces everything when it registers again. A store
speaks only for itself: under CURVE a ``Publish``, ``Have`` or ``Fetching`` naming a node is
accepted only from the key that node registered with (``owns``), and only a store's key (a node's
CLI presents its store's) may remove an object cluster-wide.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from mooncake.p2p.manifest import ObjectError, validate
from mooncake.security import kind_of
from mooncake.protocol.p2p import (Done, Failure, Fetching, FindStore, Forget, Have, Holder, ListObjects, Listing,
                                   Locate, Located, Manifest, ObjectInfo, P2PMsg, Publish, RemoveObject, StoreAt, bitmap)

log = logging.getLogger(__name__)


@dataclass
class Entry:
    manifest: Manifest
    holders: dict[str, set[int]] = field(default_factory=dict)  # store node id -> chunks held
    fetching: dict[str, list[int]] = field(default_factory=dict)  # store node id -> chunks it is fetching


class P2PIndex:
    def __init__(self, cluster: Any, send: Callable[[str, P2PMsg], None],
                 owns: Callable[[str, str], bool] = lambda node_id, peer: True) -> None:
        """``cluster``: the conductor's node registry; ``send(node_id, msg)`` reaches a registered node;
        ``owns(node_id, peer)``: whether a sender with this peer key may speak for that node."""
        self.cluster = cluster
        self.send = send
        self.owns = owns
        self.objects: dict[str, Entry] = {}

    def handlers(self) -> dict[type, Callable[[Any, str], P2PMsg]]:
        """Message type -> its answer, given the message and the sender's peer key ("" without CURVE)."""
        writes = {Publish: self.publish, Have: self.have, Fetching: self.fetching}
        return {**{t: self._as_owner(h) for t, h in writes.items()},
                Locate: lambda msg, peer: self.locate(msg), ListObjects: lambda msg, peer: self.list(msg),
                FindStore: lambda msg, peer: self.find_store(msg), RemoveObject: self._remove_by_store}

    def _remove_by_store(self, msg: RemoveObject, peer: str) -> P2PMsg:
        if peer and kind_of(peer) != "store":
            return Failure(f"removing {msg.name} takes a store's key (mooncake p2p rm on a node)", "forbidden")
        return self.remove(msg)

    def _as_owner(self, handler: Callable[[Any], P2PMsg]) -> Callable[[Any, str], P2PMsg]:
        def checked(msg: Any, peer: str) -> P2PMsg:
            if not self.owns(msg.node_id, peer):
                log.warning("p2p: %s for node %s from another key: refused", type(msg).__name__, msg.node_id)
                return Failure(f"only node {msg.node_id!r} may say what it holds", "unauthorized")
            return handler(msg)
        return checked

    def _store(self, node_id: str) -> Any:
        node = self.cluster.get(node_id)
        return node if node is not None and node.role == "store" and "p2p" in node.endpoints and node.takes_work \
            else None

    def publish(self, msg: Publish) -> P2PMsg:
        try:
            m = validate(msg.manifest)
        except ObjectError as e:
            return Failure(str(e), "bad_manifest")
        entry = self.objects.get(m.name)
        if entry is not None and entry.manifest.version != m.version:
            return Failure(f"{m.name} is already published with different content (version "
                           f"{entry.manifest.version[:12]}, this is {m.version[:12]}): remove it first "
                           f"(mooncake p2p rm {m.name}) or publish under another name", "conflict")
        if entry is None:
            entry = self.objects[m.name] = Entry(m)
            log.info("p2p: %s (%d bytes, %d chunks) published by %s", m.name, m.total_bytes, len(m.checksums),
                     msg.node_id)
        entry.holders[msg.node_id] = set(range(len(m.checksums)))
        return Done()

    def have(self, msg: Have) -> P2PMsg:
        entry = self.objects.get(msg.name)
        if entry is None or entry.manifest.version != msg.version:
            return Failure(f"{msg.name}@{msg.version[:12]} is not published", "unknown")
        n = len(entry.manifest.checksums)
        chunks = {i for i in msg.chunks if 0 <= i < n}
        if msg.replace:
            entry.holders[msg.node_id] = chunks
        else:
            entry.holders.setdefault(msg.node_id, set()).update(chunks)
        if not entry.holders[msg.node_id]:
            del entry.holders[msg.node_id]
        return Done()

    def fetching(self, msg: Fetching) -> P2PMsg:
        entry = self.objects.get(msg.name)
        if entry is None:
            return Failure(f"no object named {msg.name!r}", "unknown")
        if msg.chunks:
            entry.fetching[msg.node_id] = msg.chunks
        else:
            entry.fetching.pop(msg.node_id, None)
        return Done()

    def _entry(self, name: str) -> Entry | Failure:
        entry = self.objects.get(name)
        if entry is None:
            known = ", ".join(sorted(self.objects)[:10]) or "none"
            return Failure(f"no object named {name!r} (published: {known})", "unknown")
        return entry

    def locate(self, msg: Locate) -> P2PMsg:
        entry = self._entry(msg.name)
        if isinstance(entry, Failure):
            return entry
        n = len(entry.manifest.checksums)
        holders = []
        for node_id, chunks in entry.holders.items():
            node = self._store(node_id)
            if node is not None and chunks:
                holders.append(Holder(node_id, node.name, node.endpoints["p2p"], bitmap(chunks, n)))
        fetching = [0] * n
        for node_id, chunks in entry.fetching.items():
            if self._store(node_id) is not None:
                for i in chunks:
                    if 0 <= i < n:
                        fetching[i] += 1
        return Located(entry.manifest, holders, fetching)

    def list(self, msg: ListObjects) -> P2PMsg:
        out = []
        for name in sorted(self.objects):
            e = self.objects[name]
            live = {self._store(nid).name: len(c) for nid, c in e.holders.items() if self._store(nid) is not None}
            out.append(ObjectInfo(name, e.manifest.version, e.manifest.total_bytes, len(e.manifest.checksums), live))
        return Listing(out)

    def remove(self, msg: RemoveObject) -> P2PMsg:
        entry = self._entry(msg.name)
        if isinstance(entry, Failure):
            return entry
        del self.objects[msg.name]
        for node_id in entry.holders:
            self.send(node_id, Forget(msg.name))
        return Done(f"removed {msg.name} ({len(entry.holders)} holders told)")

    def find_store(self, msg: FindStore) -> P2PMsg:
        for node in self.cluster.of_role("store"):
            if node.name == msg.node_name and "p2p" in node.endpoints:
                return StoreAt(node.node_id, node.endpoints["p2p"])
        names = sorted({n.name for n in self.cluster.of_role("store")})
        return Failure(f"no store registered for node {msg.node_name!r} (stores on: {', '.join(names) or 'none'})",
                       "no_store")

    def drop_node(self, node_id: str) -> None:
        for entry in self.objects.values():
            entry.holders.pop(node_id, None)
            entry.fetching.pop(node_id, None)
