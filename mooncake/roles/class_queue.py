"""A worker's queue of orders, served by request class (``sched/request_class.py``): a
``priority`` request before ``default`` ones, those before ``flex``; within a class, lower
``priority`` first, then arrival. A flood of flex work queued ahead never delays an
interactive request's turn."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Generic, TypeVar

from mooncake.sched.request_class import urgency

T = TypeVar("T")  # an order with a ``sampling`` (P.Sampling)


class ClassQueue(Generic[T]):
    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple[int, int, int, Any]] = asyncio.PriorityQueue()
        self._arrivals = itertools.count()

    def put_nowait(self, item: T) -> None:
        self._queue.put_nowait((*urgency(item.sampling), next(self._arrivals), item))  # type: ignore[attr-defined]

    async def get(self) -> T:
        return (await self._queue.get())[-1]

    def qsize(self) -> int:
        return self._queue.qsize()

    def empty(self) -> bool:
        return self._queue.empty()
