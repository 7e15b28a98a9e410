"""How many bytes each tenant (API key) may write to one store per minute (``[classes]
store_write_share_per_key`` of the store's capacity): a token bucket per tenant, full at the start,
refilled at the budget per minute. A put past its tenant's budget stores the blocks that still
fit and drops the rest (the store is a cache: they are recomputed or read from elsewhere), so one
key writing unique prompts as fast as it can turns a store over no faster than its budget allows
and the prefixes other tenants reuse stay. Without keys (tenant "") there is one tenant and no
budget. Buckets exist only for tenants that wrote within a minute, so the table stays as small
as the set of active keys."""

from __future__ import annotations

import time
from typing import Callable

from mooncake.tiers.timing import WINDOW_S


class WriteBudget:
    def __init__(self, bytes_per_window: int, clock: Callable[[], float] = time.monotonic) -> None:
        """``bytes_per_window``: one tenant's budget (0: no budget)."""
        self.budget = bytes_per_window
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (bytes it may still write, when)
        self.written: dict[str, int] = {}  # bytes stored per tenant since start
        self.dropped: dict[str, int] = {}  # bytes past the budget per tenant since start

    def admit(self, tenant: str, sizes: list[int]) -> int:
        """How many of a put's blocks (``sizes`` in bytes, in order) ``tenant`` may write now; the
        rest are dropped. Counts both."""
        if not self.budget or not tenant:
            n = len(sizes)
        else:
            now = self._clock()
            left, since = self._buckets.get(tenant, (float(self.budget), now))
            left = min(float(self.budget), left + (now - since) * self.budget / WINDOW_S)
            n = 0
            while n < len(sizes) and sizes[n] <= left:
                left -= sizes[n]
                n += 1
            self._buckets[tenant] = (left, now)
            if len(self._buckets) > 64:  # forget the tenants whose bucket has refilled
                self._buckets = {t: (b, at) for t, (b, at) in self._buckets.items()
                                 if b + (now - at) * self.budget / WINDOW_S < self.budget}
        if n:
            self.written[tenant] = self.written.get(tenant, 0) + sum(sizes[:n])
        if n < len(sizes):
            self.dropped[tenant] = self.dropped.get(tenant, 0) + sum(sizes[n:])
        return n
