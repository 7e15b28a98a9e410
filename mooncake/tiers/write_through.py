"""The writer thread of ``[store] ssd_admission = "write_through"``.

Every block a put admits is queued here by key; the thread copies queued keys
to the persistent tier in batches (one LMDB transaction each), off the event
loop and off the put path, so a crash loses at most the batch being written and
what was queued behind it. Keys that left the store, or already have a copy on
disk, are skipped by the store's ``write_copies``. The queue is bounded
(``max_queued`` keys): when puts outrun the disk, the excess is dropped and
counted (``dropped``) rather than queued without limit; those blocks reach the
disk as any block does without write-through (demoted, or on shutdown).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class WriteThrough:
    def __init__(self, write: Callable[[list[bytes]], int], batch_blocks: int = 64,
                 max_queued: int = 1 << 16) -> None:
        """``write(keys)`` copies a batch to disk and returns how many it wrote."""
        self._write = write
        self.batch_blocks = batch_blocks
        self.max_queued = max_queued
        self.dropped = 0  # keys not queued: the queue was full
        self._queue: deque[bytes] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.written = 0  # copies written
        self.batches = 0  # write transactions
        self._thread = threading.Thread(target=self._run, name="store-write-through", daemon=True)
        self._thread.start()

    def submit(self, keys: Iterable[bytes]) -> None:
        keys = list(keys)
        with self._cv:
            room = max(0, self.max_queued - len(self._queue))
            if len(keys) > room:
                if not self.dropped:
                    log.warning("write-through queue full (%d blocks): dropping what the disk cannot keep up "
                                "with (counted in the store's stats as write_through.dropped)", self.max_queued)
                self.dropped += len(keys) - room
                keys = keys[:room]
            self._queue.extend(keys)
            self._cv.notify()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                n = min(len(self._queue), self.batch_blocks)
                batch = [self._queue.popleft() for _ in range(n)]
                self._busy = True
            try:
                self.written += self._write(batch)
            except Exception:  # a bad batch must not stop the writer
                log.exception("write-through batch of %d blocks failed", len(batch))
            finally:
                with self._cv:
                    self._busy = False
                    self.batches += 1
                    self._cv.notify_all()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until everything queued so far is written (tests, shutdown); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Write what is queued (within ``timeout_s``), then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
