"""A capacity-bounded set of blocks in LRU order (O(1) touch, insert and evict)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class LRUBlocks:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def touch(self, h: bytes) -> bool:
        """Mark ``h`` most recently used; False when it is not held."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return True
        return False

    def insert(self, hashes: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Hold ``hashes`` (touching those already held); returns (added, evicted).
        A block evicted to make room for a later one in the same call is in both lists."""
        added: list[bytes] = []
        evicted: list[bytes] = []
        if self.capacity == 0:
            return added, evicted
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
                continue
            if len(blocks) >= self.capacity:
                evicted.append(blocks.popitem(last=False)[0])
            blocks[h] = None
            added.append(h)
        return added, evicted

    def discard(self, h: bytes) -> bool:
        return self._blocks.pop(h, 0) is None

    def leading_run(self, hashes: Iterable[bytes]) -> int:
        """How many leading ``hashes`` are held (touching them)."""
        n = 0
        blocks = self._blocks
        for h in hashes:
            if h not in blocks:
                break
            blocks.move_to_end(h)
            n += 1
        return n
