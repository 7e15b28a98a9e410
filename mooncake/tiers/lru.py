"""O(1) LRU order of one tier: key -> accounted bytes, oldest first.

``OrderedDict`` is a hash map threaded with a doubly linked list (in C): touch,
insert, remove and pop-oldest are O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class LRU:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict()
        self.total_bytes = 0

    def add(self, key: bytes, nbytes: int) -> None:
        """Insert (or refresh) ``key`` as most recently used."""
        old = self._order.pop(key, None)
        if old is not None:
            self.total_bytes -= old
        self._order[key] = nbytes
        self.total_bytes += nbytes

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> int:
        n = self._order.pop(key, None)
        if n is None:
            return 0
        self.total_bytes -= n
        return n

    def oldest(self) -> bytes | None:
        """The least recently used key; None when empty."""
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[bytes]:
        """Keys, least recently used first."""
        return iter(self._order)
