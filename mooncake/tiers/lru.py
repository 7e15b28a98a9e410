"""O(1) LRU order of one tier: key -> accounted bytes, oldest first, in two segments.

``OrderedDict`` is a hash map threaded with a doubly linked list (in C): touch,
insert, remove and pop-oldest are O(1). Blocks only flex requests wrote
(``sched/request_class.py``) sit in a segment of their own that goes first: a flex scan
of unique prompts displaces other flex blocks before any interactive prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Iterator


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict()
        self._flex: OrderedDict[bytes, int] = OrderedDict()  # evicted first
        self.total_bytes = 0

    def add(self, key: bytes, nbytes: int, flex: bool = False) -> None:
        """Insert (or refresh) ``key`` as most recently used (of the flex segment: ``flex``)."""
        self.remove(key)
        (self._flex if flex else self._order)[key] = nbytes
        self.total_bytes += nbytes

    def touch(self, key: bytes) -> None:
        (self._flex if key in self._flex else self._order).move_to_end(key)

    def remove(self, key: bytes) -> int:
        n = self._order.pop(key, None)
        if n is None:
            n = self._flex.pop(key, None)
        if n is None:
            return 0
        self.total_bytes -= n
        return n

    def oldest(self) -> bytes | None:
        """The key to evict first: the least recently used flex one, else the least recently
        used; None when empty."""
        return next(iter(self._flex or self._order), None)

    def flex_blocks(self) -> int:
        return len(self._flex)

    def __len__(self) -> int:
        return len(self._order) + len(self._flex)

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order: flex ones first, each segment least recently used first."""
        return chain(self._flex, self._order)
