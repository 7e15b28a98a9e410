"""Global KV index: block hash -> the nodes (and tiers) that hold it.

Fed by the stored/removed events of engines (device tier) and stores. Lookups
walk a request's hash chain once; a node's dead-state removal is O(its blocks).
"""

from __future__ import annotations

from typing import Container, Iterable, Sequence


class KVIndex:
    def __init__(self) -> None:
        self._where: dict[bytes, dict[str, str]] = {}  # hash -> {node_id: tier}
        self._by_node: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def add(self, node_id: str, tier: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.setdefault(node_id, set())
        for h in hashes:
            self._where.setdefault(h, {})[node_id] = tier
            mine.add(h)

    def remove(self, node_id: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.get(node_id)
        for h in hashes:
            locs = self._where.get(h)
            if locs is not None and locs.pop(node_id, None) is not None and not locs:
                del self._where[h]
            if mine is not None:
                mine.discard(h)

    def drop_node(self, node_id: str) -> int:
        """Forget everything ``node_id`` held; returns how many blocks it held."""
        mine = self._by_node.pop(node_id, set())
        for h in mine:
            locs = self._where.get(h)
            if locs is not None:
                locs.pop(node_id, None)
                if not locs:
                    del self._where[h]
        return len(mine)

    def blocks_of(self, node_id: str) -> int:
        return len(self._by_node.get(node_id, ()))

    def holders(self, h: bytes) -> dict[str, str]:
        return self._where.get(h, {})

    def prefix_runs(self, hashes: Sequence[bytes], stores: Container[str] = ()) -> tuple[dict[str, int], int]:
        """One walk of the chain: for each node, how many leading blocks it holds (runs
        from block 0); and how many leading blocks the ``stores`` hold between them."""
        runs: dict[str, int] = {}
        store_end = 0
        where = self._where
        for i, h in enumerate(hashes):
            locs = where.get(h)
            if not locs:
                break
            advanced = False
            for node in locs:
                if runs.get(node, 0) == i:
                    runs[node] = i + 1
                    advanced = True
                if store_end == i and node in stores:
                    store_end = i + 1
                    advanced = True
            if not advanced:
                break
        return runs, store_end

    def covering_run(self, hashes: Sequence[bytes], start: int, nodes: set[str],
                     prefer: Sequence[str] = ()) -> list[tuple[int, int, str]]:
        """Segments ``(start, end, node)`` covering blocks ``start..`` from ``nodes``,
        as long a leading run as they hold together; stays on one node while it can,
        and starts with the ``prefer`` nodes (e.g. those local to the reader)."""
        segments: list[tuple[int, int, str]] = []
        current: str | None = None
        seg_start = start
        for i in range(start, len(hashes)):
            locs = self._where.get(hashes[i])
            if not locs:
                break
            if current is None or current not in locs:
                nxt = next((n for n in prefer if n in locs and n in nodes), None) or next(
                    (n for n in locs if n in nodes), None)
                if nxt is None:
                    break
                if current is not None:
                    segments.append((seg_start, i, current))
                current, seg_start = nxt, i
        else:
            i = len(hashes)
        if current is not None:
            segments.append((seg_start, i, current))
        return [s for s in segments if s[1] > s[0]]
