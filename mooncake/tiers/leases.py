"""Leases: blocks being read by an in-flight transfer may not be evicted.

A lease is counted (several readers may hold the same block) and has a
deadline; an expired lease no longer pins its block, whether released or not.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable


class Leases:
    def __init__(self, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_s = max_s
        self.clock = clock
        self._held: dict[bytes, tuple[int, float]] = {}  # key -> (holders, deadline)

    def acquire(self, keys: Iterable[bytes], seconds: float) -> None:
        deadline = self.clock() + min(seconds, self.max_s)
        for k in keys:
            count, old = self._held.get(k, (0, 0.0))
            self._held[k] = (count + 1, max(old, deadline))

    def release(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            held = self._held.get(k)
            if held is None:
                continue
            if held[0] <= 1:
                del self._held[k]
            else:
                self._held[k] = (held[0] - 1, held[1])

    def is_leased(self, key: bytes) -> bool:
        held = self._held.get(key)
        if held is None:
            return False
        if held[1] <= self.clock():
            del self._held[key]
            return False
        return True

    def drop(self, key: bytes) -> None:
        self._held.pop(key, None)

    def __len__(self) -> int:
        now = self.clock()
        return sum(1 for _, d in self._held.values() if d > now)
