"""A worker's queue of orders, served by request class (``sched/request_class.py``): a
``priority`` request before ``default`` ones, those before ``flex``; within a class, lower
``priority`` first, then the tenants' fair order, then arrival. A flood of flex work queued ahead
never delays an interactive request's turn, nor one tenant's burst another tenant's."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Generic, TypeVar

from mooncake.sched.request_class import urgency

T = TypeVar("T")  # an order with a ``sampling`` (P.Sampling)


class ClassQueue(Generic[T]):
    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple] = asyncio.PriorityQueue()
        self._arrivals = itertools.count()
        self.changed = asyncio.Event()  # set on each put: a waiting taker looks at the queue again

    def put_nowait(self, item: T) -> None:
        self._put((*urgency(item.sampling), next(self._arrivals), item))  # type: ignore[attr-defined]

    async def get(self) -> T:
        return (await self.get_entry())[-1]

    async def get_entry(self) -> tuple:
        """The most urgent (key..., item); ``put_back`` returns it to its place."""
        return await self._queue.get()

    def put_back(self, entry: tuple) -> None:
        self._put(entry)

    def _put(self, entry: tuple) -> None:
        self._queue.put_nowait(entry)
        self.changed.set()

    def qsize(self) -> int:
        return self._queue.qsize()

    def empty(self) -> bool:
        return self._queue.empty()


class TenantSlots:
    """Places for the prompts one worker runs at once in a lane: ``cap``, and past it one for a tenant
    with none running, so that one tenant's burst holding every place never keeps another tenant's
    prompt waiting for one (without API keys, one tenant: ``cap``)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.running: Counter[str] = Counter()
        self.freed = asyncio.Event()

    def may_start(self, tenant: str) -> bool:
        return sum(self.running.values()) < self.cap or not self.running[tenant]

    def take(self, tenant: str) -> None:
        self.running[tenant] += 1

    def release(self, tenant: str) -> None:
        self.running[tenant] -= 1
        if self.running[tenant] <= 0:
            del self.running[tenant]
        self.freed.set()


async def next_to_start(queue: ClassQueue[T], slots: TenantSlots) -> T:
    """The most urgent queued order whose tenant may start a prompt now, once one may: a place freed
    or a more urgent order arrived (its tenant may have none running) puts the question again."""
    while True:
        entry = await queue.get_entry()
        if slots.may_start(entry[-1].sampling.tenant):  # type: ignore[attr-defined]
            return entry[-1]
        queue.put_back(entry)  # still queued (counted as waiting) while no place is free for it
        queue.changed.clear()
        slots.freed.clear()
        waits = [asyncio.ensure_future(e.wait()) for e in (queue.changed, slots.freed)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
