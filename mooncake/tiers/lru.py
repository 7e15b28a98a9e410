"""O(1) LRU order of one tier: key -> accounted bytes, oldest first, in three segments.

``OrderedDict`` is a hash map threaded with a doubly linked list (in C): touch,
insert, remove and pop-oldest are O(1). Blocks only flex requests wrote
(``sched/request_class.py``) sit in a segment of their own that goes first: a flex scan
of unique prompts displaces other flex blocks before any interactive prefix. Blocks a
session keeps (until a time: ``[classes] session_ttl_s`` after its turn) sit in one that
goes last, in the order they were kept; once their time is up (a heap of their deadlines says
when), or once the tenant that kept one last keeps more than its quota in the store (``[classes]
session_blocks_per_key``, ``mooncake/tenant_quota.py``: its oldest kept ones go), they are the
oldest of the rest.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from itertools import chain
from typing import Callable, Iterator

from mooncake.deadline_heap import DeadlineHeap
from mooncake.tenant_quota import TenantQuota


class LRU:
    def __init__(self, clock: Callable[[], float] = time.monotonic, keepers: TenantQuota[bytes] | None = None) -> None:
        """``keepers``: who keeps each kept key, and how many one tenant may keep; a store's tiers
        share one, so that its quota holds in the whole store (default: this LRU's own, no limit)."""
        self._order: OrderedDict[bytes, int] = OrderedDict()
        self._flex: OrderedDict[bytes, int] = OrderedDict()  # evicted first
        self._kept: OrderedDict[bytes, int] = OrderedDict()  # evicted last, soonest to expire first
        self._until: dict[bytes, float] = {}  # of the kept ones
        self._deadlines: DeadlineHeap[bytes] = DeadlineHeap(
            lambda key, until: self._until.get(key) == until)  # else: removed or kept longer since
        self.keepers: TenantQuota[bytes] = TenantQuota() if keepers is None else keepers
        self._clock = clock
        self.total_bytes = 0

    def add(self, key: bytes, nbytes: int, flex: bool = False, until: float = 0.0, tenant: str = "") -> list[bytes]:
        """Insert (or refresh) ``key`` as most recently used: of the flex segment (``flex``), or
        kept until ``until`` (``time.monotonic``) if that is still to come, by ``tenant``. Returns
        the keys no longer kept because ``tenant`` now keeps more than its quota (its oldest; those
        of this tier are the oldest of its ordinary ones now, the caller sees to the others)."""
        self.remove(key)
        self.total_bytes += nbytes
        if until <= self._clock():
            (self._flex if flex else self._order)[key] = nbytes
            return []
        self._kept[key] = nbytes
        self._until[key] = until
        self._deadlines.push(key, until, len(self._until))
        over = self.keepers.keep(key, tenant)
        for old in over:
            self.stop_keeping(old)
        return over

    def stop_keeping(self, key: bytes) -> None:
        """A kept ``key`` (if here) becomes the oldest of the ordinary ones, as if its time were up
        (its tenant went past its quota: ``keepers`` no longer counts it)."""
        n = self._kept.pop(key, None)
        if n is not None:
            del self._until[key]
            self._order[key] = n
            self._order.move_to_end(key, last=False)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` as most recently used (a kept one stays in expiry order)."""
        if key not in self._kept:
            (self._flex if key in self._flex else self._order).move_to_end(key)

    def remove(self, key: bytes) -> int:
        n = self._order.pop(key, None)
        if n is None:
            n = self._flex.pop(key, None)
        if n is None:
            n = self._kept.pop(key, None)
            self._until.pop(key, None)
            self.keepers.drop(key)
        if n is None:
            return 0
        self.total_bytes -= n
        return n

    def oldest(self) -> bytes | None:
        """The key to evict first: the least recently used flex one, else the least recently
        used, else the kept one that expires soonest; None when empty."""
        self._expire()
        return next(iter(self._flex or self._order or self._kept), None)

    def check(self) -> None:
        """Assert that each kept key has a tenant, none past its quota (tests)."""
        owners = self.keepers.owners()
        assert set(self._until) == set(self._kept) and all(k in owners for k in self._kept)
        self.keepers.check(owners)

    def flex_blocks(self) -> int:
        return len(self._flex)

    def kept_blocks(self) -> int:
        self._expire()
        return len(self._kept)

    def __len__(self) -> int:
        return len(self._order) + len(self._flex) + len(self._kept)

    def __iter__(self) -> Iterator[bytes]:
        """Keys in eviction order: flex ones first, then the rest, then the kept ones; each segment
        least recently used (kept: soonest to expire) first."""
        self._expire()
        return chain(self._flex, self._order, self._kept)

    def _expire(self) -> None:
        """Kept keys whose time is up join the ordinary segment as its oldest."""
        expired = []
        for key in self._deadlines.due(self._clock()):
            del self._until[key]
            self.keepers.drop(key)
            expired.append((key, self._kept.pop(key)))
        for key, n in reversed(expired):
            self._order[key] = n
            self._order.move_to_end(key, last=False)
