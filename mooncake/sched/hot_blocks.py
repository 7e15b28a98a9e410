"""Hot-block detection: hits per block in a sliding time window."""

from __future__ import annotations

from collections import Counter, deque
from typing import Sequence


class HotBlocks:
    def __init__(self, threshold: int, window_s: float) -> None:
        self.threshold = threshold
        self.window_s = window_s
        self._hits: deque[tuple[float, Sequence[bytes]]] = deque()
        self._counts: Counter[bytes] = Counter()

    def _expire(self, now: float) -> None:
        while self._hits and now - self._hits[0][0] > self.window_s:
            _, hashes = self._hits.popleft()
            self._counts.subtract(hashes)
            for h in hashes:
                if self._counts[h] <= 0:
                    del self._counts[h]

    def hit(self, hashes: Sequence[bytes], now: float) -> list[bytes]:
        """Record one hit on each of ``hashes``; returns those now at or above the threshold."""
        self._expire(now)
        if not hashes:
            return []
        self._hits.append((now, hashes))
        self._counts.update(hashes)
        return [h for h in hashes if self._counts[h] >= self.threshold]

    def count(self, h: bytes) -> int:
        return self._counts.get(h, 0)
