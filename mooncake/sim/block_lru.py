"""A capacity-bounded set of blocks in LRU order (O(1) touch, insert and evict), in two
segments as the device cache and the store tiers keep them (``engine/kv_cache.py``,
``tiers/lru.py``): blocks only flex requests have used are evicted first, and a flex block
displaces only other flex blocks (where none is left to evict it is not held)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, NamedTuple


class Inserted(NamedTuple):
    added: list[bytes]
    evicted: list[bytes]  # a block evicted to make room for a later one of the same call is in both
    evicted_flex: list[bytes]  # those of ``evicted`` that were flex blocks


class LRUBlocks:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._flex: OrderedDict[bytes, None] = OrderedDict()  # used by flex requests alone

    def __len__(self) -> int:
        return len(self._blocks) + len(self._flex)

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks or h in self._flex

    def is_flex(self, h: bytes) -> bool:
        return h in self._flex

    def touch(self, h: bytes, flex: bool = False) -> bool:
        """Mark ``h`` most recently used (used by a flex request, or else by another, which
        makes it no longer a flex block); False when it is not held."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return True
        if h in self._flex:
            if flex:
                self._flex.move_to_end(h)
            else:
                del self._flex[h]
                self._blocks[h] = None
            return True
        return False

    def insert(self, hashes: Iterable[bytes], flex: bool = False) -> Inserted:
        """Hold ``hashes`` (touching those already held), for a flex request or another."""
        out = Inserted([], [], [])
        if self.capacity == 0:
            return out
        segment = self._flex if flex else self._blocks
        for h in hashes:
            if self.touch(h, flex):
                continue
            if len(self) >= self.capacity:
                if self._flex:
                    gone = self._flex.popitem(last=False)[0]
                    out.evicted_flex.append(gone)
                elif flex:  # a flex block never displaces another's
                    continue
                else:
                    gone = self._blocks.popitem(last=False)[0]
                out.evicted.append(gone)
            segment[h] = None
            out.added.append(h)
        return out

    def discard(self, h: bytes) -> bool:
        return self._blocks.pop(h, 0) is None or self._flex.pop(h, 0) is None

    def leading_run(self, hashes: Iterable[bytes], flex: bool = False) -> int:
        """How many leading ``hashes`` are held (touching them, as used by a flex request or another)."""
        n = 0
        for h in hashes:
            if not self.touch(h, flex):
                break
            n += 1
        return n
