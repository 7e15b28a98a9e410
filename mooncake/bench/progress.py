"""A dependency-free progress bar on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from mooncake.bench.client import RequestRecord


class ProgressBar:
    """``[#####-----] 12/40 ok 10 429 1 err 1 3.2s``, redrawn at most every ``interval_s``."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None,
                 width: int = 30, interval_s: float = 0.1) -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.interval_s = interval_s
        self.done = self.ok = self.rejected = self.errors = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn_done = -1

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        if record.ok:
            self.ok += 1
        elif record.rejected:
            self.rejected += 1
        else:
            self.errors += 1
        now = time.perf_counter()
        if now - self._last_draw >= self.interval_s or self.done >= self.total:
            self._last_draw = now
            self.draw()

    def render(self) -> str:
        filled = min(self.width, self.width * self.done // self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self._start
        return (f"[{bar}] {self.done}/{self.total} ok {self.ok} 429 {self.rejected} "
                f"err {self.errors} {elapsed:.1f}s")

    def draw(self) -> None:
        self._drawn_done = self.done
        if self.enabled:
            self.stream.write("\r" + self.render())
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            if self._drawn_done != self.done:
                self.draw()
            self.stream.write("\n")
            self.stream.flush()
