"""Global KV index: block hash -> the nodes (and tiers) that hold it.

Fed by the stored/removed events of engines (device tier) and stores. Each node
has a bit while it holds anything, and each block the mask of its holders'
bits, so a lookup walks a request's hash chain with one probe per block for
every holder at once. A node's dead-state removal is O(its blocks).
"""

from __future__ import annotations

from itertools import groupby, islice, takewhile
from typing import Container, Iterable, Iterator, Sequence

_MAX_MASKS = 1 << 16  # distinct holder masks kept as shared objects (a cache: cleared when over)


class KVIndex:
    def __init__(self) -> None:
        self._where: dict[bytes, dict[str, str]] = {}  # hash -> {node_id: tier}, in the order they stored it
        self._held: dict[bytes, int] = {}  # hash -> its holders' bits OR-ed (the keys of ``_where``)
        self._by_node: dict[str, set[bytes]] = {}
        self._bit: dict[str, int] = {}  # node_id -> its bit (a power of two), from its first add to drop_node
        self._node_of: dict[int, str] = {}  # bit -> node_id
        self._free_bits: list[int] = []  # bits of dropped nodes, for the next new ones
        # One int object per distinct mask: equal masks of consecutive blocks are then the same
        # object, which the walk's run-length grouping compares by identity; it also saves an
        # int per block.
        self._masks: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def _bit_of(self, node_id: str) -> int:
        bit = self._bit.get(node_id)
        if bit is None:
            bit = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            self._bit[node_id] = bit
            self._node_of[bit] = node_id
        return bit

    def _shared_masks(self) -> dict[int, int]:
        if len(self._masks) > _MAX_MASKS:
            self._masks.clear()
        return self._masks

    def add(self, node_id: str, tier: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.setdefault(node_id, set())
        bit = self._bit_of(node_id)
        where, held, masks = self._where, self._held, self._shared_masks()
        for h in hashes:
            where.setdefault(h, {})[node_id] = tier
            m = held.get(h, 0) | bit
            held[h] = masks.setdefault(m, m)
            mine.add(h)

    def remove(self, node_id: str, hashes: Iterable[bytes]) -> None:
        mine = self._by_node.get(node_id)
        keep = ~self._bit.get(node_id, 0)
        self._forget(node_id, keep, hashes if mine is None else self._discarding(mine, hashes))

    @staticmethod
    def _discarding(mine: set[bytes], hashes: Iterable[bytes]) -> Iterator[bytes]:
        for h in hashes:
            mine.discard(h)
            yield h

    def _forget(self, node_id: str, keep: int, hashes: Iterable[bytes]) -> None:
        """Take ``node_id`` (all bits but ``keep``) off the holders of ``hashes``."""
        where, held, masks = self._where, self._held, self._shared_masks()
        for h in hashes:
            locs = where.get(h)
            if locs is not None and locs.pop(node_id, None) is not None:
                if locs:
                    m = held[h] & keep
                    held[h] = masks.setdefault(m, m)
                else:
                    del where[h], held[h]

    def drop_node(self, node_id: str) -> int:
        """Forget everything ``node_id`` held (its bit goes free); returns how many blocks it held."""
        mine = self._by_node.pop(node_id, set())
        bit = self._bit.pop(node_id, 0)
        self._forget(node_id, ~bit, mine)
        if bit:
            del self._node_of[bit]
            self._free_bits.append(bit)
        return len(mine)

    def blocks_of(self, node_id: str) -> int:
        return len(self._by_node.get(node_id, ()))

    def holders(self, h: bytes) -> dict[str, str]:
        return self._where.get(h, {})

    def _nodes_in(self, mask: int) -> Iterator[tuple[int, str]]:
        """(bit, node) for each bit of ``mask``."""
        node_of = self._node_of
        while mask:
            low = mask & -mask
            yield low, node_of[low]
            mask ^= low

    def _run_ends(self, hashes: Iterable[bytes], alive: int) -> list[tuple[int, int]]:
        """(bits, n): the bits of ``alive`` whose run along ``hashes`` ends after n blocks,
        shortest first. One probe per block for all of them (in C), and a Python step only
        where the holders' mask changes (``groupby`` of the shared mask objects)."""
        ends: list[tuple[int, int]] = []
        n = 0
        for mask, same in groupby(map(self._held.get, hashes)):
            if mask is None:  # a block nobody holds
                break
            dropped = alive & ~mask
            if dropped:
                ends.append((dropped, n))
                alive ^= dropped
                if not alive:
                    return ends
            n += len(list(same))
        if alive:
            ends.append((alive, n))
        return ends

    def prefix_runs(self, hashes: Sequence[bytes], stores: Container[str] = ()) -> tuple[dict[str, int], int]:
        """For each node, how many leading blocks of the chain it holds (runs from block 0);
        and how many leading blocks the ``stores`` hold between them. One walk for every
        holder: a node's run ends at the first block whose holders' mask lacks its bit."""
        runs: dict[str, int] = {}
        first = self._held.get(hashes[0], 0) if hashes else 0
        if not first:
            return runs, 0
        store_end = 0
        for bits, n in self._run_ends(hashes, first):
            for _, node in self._nodes_in(bits):
                runs[node] = n
                if node in stores:
                    store_end = n
        while 0 < store_end < len(hashes):  # another store may go on where the longest one stops
            at = self._held.get(hashes[store_end], 0)
            from_stores = sum(b for b, node in self._nodes_in(at) if node in stores)
            if not from_stores:
                break
            store_end += self._run_ends(islice(hashes, store_end, None), from_stores)[-1][1]
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
            node = next((p for p in prefer if p in locs and p in nodes), None) or next(
                (p for p in locs if p in nodes), None)
            if node is None:
                break
            known = runs.get(node, 0) if runs is not None else 0
            run = min(known, n) - i if known > i else self._run(node, hashes, i)
            segments.append((i, i + run, node))
            i += run
        return segments
