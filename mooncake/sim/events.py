"""The event engine: a clock and a heap of timed callbacks, run in time order.

Events at the same time run in the order they were scheduled (a sequence number
breaks ties), so a simulation is deterministic.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at time ``t`` (never earlier than now)."""
        if t < self.now:
            t = self.now
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float | None = None) -> None:
        """Process events in time order, until none is left (or the next is after ``until``)."""
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.processed += 1
            fn(*args)
