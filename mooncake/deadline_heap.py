"""When the keys a session keeps are due (the engine's prefix cache, a store tier's LRU): a heap of
(until, order, key), soonest first, ``order`` breaking ties in the order they were kept.

A key kept again, released or evicted leaves its old entry behind (stale: ``live(key, until)``
says no). Stale entries are skipped when due, and all dropped at once when the heap grows to
twice the keys kept, so the bookkeeping stays bounded by what is held, not by the traffic."""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, Hashable, Iterator, TypeVar

K = TypeVar("K", bound=Hashable)
MIN_ENTRIES = 64  # below this many entries the heap is never compacted


class DeadlineHeap(Generic[K]):
    def __init__(self, live: Callable[[K, float], bool]) -> None:
        self._live = live
        self._heap: list[tuple[float, int, K]] = []
        self._order = itertools.count()

    def push(self, key: K, until: float, kept: int) -> None:
        """``key`` is due at ``until``; ``kept``: how many keys are kept now (live entries)."""
        heapq.heappush(self._heap, (until, next(self._order), key))
        if len(self._heap) > max(MIN_ENTRIES, 2 * kept - 1):
            self._heap = [e for e in self._heap if self._live(e[2], e[0])]
            heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[K]:
        """The live keys due by ``now``, soonest first, each removed from the heap."""
        while self._heap and self._heap[0][0] <= now:
            until, _, key = heapq.heappop(self._heap)
            if self._live(key, until):
                yield key

    def __len__(self) -> int:
        return len(self._heap)
