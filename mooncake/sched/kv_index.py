"""Global KV index: block hash -> the nodes (and tiers) that hold it.

Fed by the stored/removed events of engines (device tier) and stores. Lookups
walk a request's hash chain once; a node's dead-state removal is O(its blocks).
"""

from __future__ import annotations

from itertools import chain, islice, takewhile
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
        """For each node, how many leading blocks of the chain it holds (runs from block 0);
        and how many leading blocks the ``stores`` hold between them. Each run is counted
        in C (``takewhile`` over the node's own set), not by a Python step per block."""
        runs: dict[str, int] = {}
        locs = self._where.get(hashes[0]) if hashes else None
        if not locs:
            return runs, 0
        for node in locs:
            runs[node] = self._run(node, hashes, 0)
        store_end = max((r for node, r in runs.items() if node in stores), default=0)
        while 0 < store_end < len(hashes):  # another store may go on where the longest one stops
            locs = self._where.get(hashes[store_end])
            more = max((self._run(s, hashes, store_end) for s in locs if s in stores), default=0) if locs else 0
            if not more:
                break
            store_end += more
        return runs, store_end

    def _run(self, node_id: str, hashes: Sequence[bytes], start: int) -> int:
        """How many blocks of ``hashes`` from ``start`` on ``node_id`` holds without a gap."""
        held = self._by_node.get(node_id)
        if not held:
            return 0
        return len(list(takewhile(held.__contains__, islice(hashes, start, None) if start else hashes)))

    def covering_run(self, hashes: Sequence[bytes], start: int, nodes: set[str],
                     prefer: Sequence[str] = (), runs: dict[str, int] | None = None) -> list[tuple[int, int, str]]:
        """Segments ``(start, end, node)`` covering blocks ``start..`` from ``nodes``,
        as long a leading run as they hold together; stays on one node while it can,
        and starts with the ``prefer`` nodes (e.g. those local to the reader). Each
        segment's length is counted in C (``_run``), or read from ``runs`` (``prefix_runs``
        of the same chain: a node whose run from block 0 reaches past ``i`` holds exactly
        ``runs[node] - i`` blocks from ``i``)."""
        segments: list[tuple[int, int, str]] = []
        i, n = start, len(hashes)
        while i < n:
            locs = self._where.get(hashes[i])
            if not locs:
                break
            for node in chain(prefer, locs):  # the first preferred holder, else the first holder
                if node in locs and node in nodes:
                    break
            else:
                break
            known = runs.get(node, 0) if runs is not None else 0
            run = min(known, n) - i if known > i else self._run(node, hashes, i)
            segments.append((i, i + run, node))
            i += run
        return segments
