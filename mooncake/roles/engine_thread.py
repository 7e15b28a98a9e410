"""The one thread that runs a worker's engine calls, the most urgent first.

A role's coroutines queue engine calls (a forward, a block import, a sequence's allocation)
faster than one thread runs them. In arrival order, an interactive request's every step
would wait behind the calls flex work queued before it: a flood of flex prompts puts a
forward and its exports ahead of each of them. Here each call carries an urgency (its
request's class rank, or its whole ``urgency`` — class, priority, the tenants' fair order —
``sched/request_class.py``: lower first) and waits only for the call running and the more
urgent ones; calls of one urgency keep their order. A coroutine's calls
take the urgency set in its context (``ENGINE_URGENCY``, inherited by the tasks it starts),
or the one it names.

A request makes its calls one after another, and between two of them (while its coroutine
resumes) the queue may hold only less urgent work: a long flex forward would start then, and
the request's next call wait it out, at every step. While a request of some urgency is
``expecting`` calls, a less urgent call waits up to ``grace_s`` for one of them to come
first: by class and priority, and within one class and priority by the tenants' fair order
when the urgency names the tenant (``request_class.tenant_urgency``): a tenant's burst gives
way to another tenant whose turn it is, while one tenant's requests never wait for each
other's calls (their forwards batch). Never longer, so a request that waits on flex work
(blocks it computes, a place it holds) is never stuck behind it.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import threading
import time
from collections import Counter
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from mooncake.sched.request_class import DEFAULT_RANK

Urgency = int | tuple  # a class rank, or ``request_class.urgency``; compared as tuples
ENGINE_URGENCY: contextvars.ContextVar[Urgency] = contextvars.ContextVar("engine_urgency", default=DEFAULT_RANK)


def _key(urgency: Urgency) -> tuple:
    return urgency if isinstance(urgency, tuple) else (urgency,)


def _gives_way(call: tuple, expected: tuple) -> bool:
    """Whether a call of urgency ``call`` gives a request of urgency ``expected`` its grace: a
    more urgent class or priority, or (both naming their tenants) another tenant's earlier turn."""
    if call[:2] != expected[:2]:
        return expected[:2] < call[:2]
    return len(call) > 3 and len(expected) > 3 and call[3] != expected[3] and expected[2] < call[2]


class EngineThread(Executor):
    def __init__(self, name: str, grace_s: float = 0.05) -> None:
        self.grace_s = grace_s
        self._calls: list[tuple] = []  # heap of (urgency, order, future, fn, args, kwargs)
        self._expected: Counter[tuple] = Counter()  # (class rank, priority[, fair tag, tenant]) -> requests expecting calls
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, urgency: Urgency | None = None, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` after the calls more urgent than ``urgency`` (default: the
        caller's context's) and those of its urgency queued before it."""
        f: Future = Future()
        key = _key(ENGINE_URGENCY.get() if urgency is None else urgency)
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine thread is shut down")
            heapq.heappush(self._calls, (key, next(self._order), f, fn, args, kwargs))
            self._cond.notify()
        return f

    @contextmanager
    def expecting(self, urgency: Urgency) -> Iterator[None]:
        """While in it, a request of ``urgency`` makes calls: less urgent ones give them ``grace_s``."""
        self._expect(urgency, 1)
        try:
            yield
        finally:
            self._expect(urgency, -1)

    @contextmanager
    def waiting_on_others(self, urgency: Urgency | None = None) -> Iterator[None]:
        """Within ``expecting(urgency)`` (default: the caller's context's), while the request waits
        on other work (blocks another request computes, room it frees, a transfer): no grace for it
        meanwhile."""
        urgency = ENGINE_URGENCY.get() if urgency is None else urgency
        self._expect(urgency, -1)
        try:
            yield
        finally:
            self._expect(urgency, 1)

    def _expect(self, urgency: Urgency, change: int) -> None:
        key = _key(urgency)
        key = key if len(key) > 3 else key[:2]
        with self._cond:
            self._expected[key] += change
            if self._expected[key] <= 0:
                del self._expected[key]
            self._cond.notify()

    def _next(self) -> tuple:
        with self._cond:
            since = None
            while True:
                if not self._calls:
                    self._cond.wait()
                    continue
                head = self._calls[0]
                if head[2] is None or not any(_gives_way(head[0], e) for e in self._expected):
                    return heapq.heappop(self._calls)
                since = time.monotonic() if since is None else since
                left = self.grace_s - (time.monotonic() - since)
                if left <= 0:
                    return heapq.heappop(self._calls)
                self._cond.wait(left)

    def _work(self) -> None:
        while True:
            _, _, f, fn, args, kwargs = self._next()
            if f is None:  # shut down
                return
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the caller gets it
                f.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; those queued run first unless ``cancel_futures``."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for item in self._calls:
                    if item[2] is not None:
                        item[2].cancel()
                self._calls = []
            heapq.heappush(self._calls, ((float("inf"),), next(self._order), None, None, (), {}))
            self._cond.notify()
        if wait:
            self._thread.join()
