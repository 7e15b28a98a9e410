"""Global KV index: block hash -> the nodes (and tiers) that hold it.

Fed by the stored/removed events of engines (device tier) and stores. Lookups
walk a request's hash chain once; a node's dead-state removal is O(its blocks).
The walk of ``prefix_runs`` runs in C over a flat copy of block -> holders
(``fingerprint_table.py``, a bit per node) where that can be built, else over
each node's own dict of blocks; both give the same answer. Each node's dict is the only
Python copy: adding and removing a batch of blocks are C loops over it (no Python step per
block), and the holders of one block are found by asking each node (a cluster has tens).
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import chain, islice, repeat, takewhile
from typing import Collection, Iterable, Iterator, Sequence

from mooncake.sched.fingerprint_table import FingerprintTable


class KVIndex:
    def __init__(self, native: bool = True) -> None:
        """``native``: walk chains in C where it can be built (False: always in Python)."""
        # Nothing below holds an object the garbage collector tracks per block (bytes, str):
        # a full collection does not walk a million blocks (it did, for ≈200 ms, with a dict per block).
        self._by_node: dict[str, dict[bytes, str]] = {}  # node -> {hash: tier}
        self._table = FingerprintTable.create() if native else None
        self._bit_of: dict[str, int] = {}  # node -> its bit, from its first add to drop_node
        self._node_at: list[str] = []  # bit -> node
        self._free_bits: list[int] = []  # a heap: the lowest free bit is reused first
        self.tiers_seen: set[str] = set()  # every tier a block was ever added in

    @property
    def native(self) -> bool:
        return self._table is not None

    def _bit(self, node_id: str) -> int:
        bit = self._bit_of.get(node_id)
        if bit is None:
            bit = heapq.heappop(self._free_bits) if self._free_bits else len(self._node_at)
            if bit == len(self._node_at):
                self._node_at.append(node_id)
            self._node_at[bit] = node_id
            self._bit_of[node_id] = bit
        return bit

    def _holders(self, h: bytes) -> list[str]:
        """The nodes holding block ``h``, in the order of their bits."""
        nodes = [node for node, mine in self._by_node.items() if h in mine]
        if len(nodes) > 1:
            nodes.sort(key=self._bit_of.__getitem__)
        return nodes

    def __len__(self) -> int:
        """Distinct blocks indexed."""
        if self._table is not None:
            return len(self._table)
        return len(set().union(*self._by_node.values()))

    def add(self, node_id: str, tier: str, hashes: Iterable[bytes]) -> None:
        bit = self._bit(node_id)
        mine = self._by_node.setdefault(node_id, {})
        hashes = list(hashes)
        mine.update(zip(hashes, repeat(tier)))
        self.tiers_seen.add(tier)
        if self._table is not None and hashes:
            self._table.add(bit, hashes)

    def remove(self, node_id: str, hashes: Iterable[bytes]) -> None:
        bit = self._bit_of.get(node_id)
        if bit is None:
            return
        hashes = list(hashes)
        deque(map(self._by_node[node_id].pop, hashes, repeat(None)), maxlen=0)  # each popped, in C
        if self._table is not None and hashes:
            self._table.remove(bit, hashes)

    def drop_node(self, node_id: str) -> int:
        """Forget everything ``node_id`` held; returns how many blocks it held."""
        bit = self._bit_of.pop(node_id, None)
        mine = self._by_node.pop(node_id, {})
        if bit is not None:
            if self._table is not None:
                self._table.clear_bit(bit)
            heapq.heappush(self._free_bits, bit)
        return len(mine)

    def blocks_of(self, node_id: str) -> int:
        return len(self._by_node.get(node_id, ()))

    def holders(self, h: bytes) -> dict[str, str]:
        """The nodes holding block ``h`` (in the order they got their bits) and their tiers."""
        return {node: self._by_node[node][h] for node in self._holders(h)}

    def holds(self, node_id: str, h: bytes) -> bool:
        return h in self._by_node.get(node_id, ())

    def prefix_runs(self, hashes: Sequence[bytes], stores: Collection[str] = ()) -> tuple[dict[str, int], int]:
        """For each node, how many leading blocks of the chain it holds (runs from block 0);
        and how many leading blocks the ``stores`` hold between them. In C over the flat
        table, or per holder over its own blocks (``takewhile``), never a Python step per block."""
        if self._table is not None:
            bit_of, mask = self._bit_of, 0
            for s in stores:
                bit = bit_of.get(s)
                if bit is not None:
                    mask |= 1 << bit
            pairs, store_end = self._table.walk(hashes, mask)
            node_at, it = self._node_at, iter(pairs)
            return {node_at[bit]: run for bit, run in zip(it, it)}, store_end
        if not hashes:
            return {}, 0
        runs = {node: self._run(node, hashes, 0) for node in self._holders(hashes[0])}
        store_end = max((r for node, r in runs.items() if node in stores), default=0)
        while 0 < store_end < len(hashes):  # another store may go on where the longest one stops
            more = max((self._run(s, hashes, store_end) for s in self._holders(hashes[store_end]) if s in stores),
                       default=0)
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

    def covering_run(self, hashes: Sequence[bytes], start: int, nodes: Collection[str],
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
            locs = self._holders(hashes[i])
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

    def run_tiers(self, hashes: Sequence[bytes], nodes: Collection[str],
                  runs: dict[str, int] | None = None) -> Iterator[str]:
        """The tier of each block of ``hashes`` from block 0, on the node ``covering_run`` reads it
        from, as far as the ``nodes`` cover the chain: looked up in C as it is consumed (at once:
        the index may change)."""
        by_node = self._by_node
        return chain.from_iterable(map(by_node[node].__getitem__, hashes[start:end])
                                   for start, end, node in self.covering_run(hashes, 0, nodes, (), runs))
