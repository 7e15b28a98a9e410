"""Ticks of the wall clock, shared by every process of a cluster.

What can wait a little goes to the conductor on these ticks: a node's heartbeat (on a tick of
``heartbeat_s / 2``), the blocks it cached since (the next tick of ``REPORT_EVERY_S``), a
frontend's releases (likewise); the conductor's liveness checks run on them too. Every process
reads the same clock (hosts within milliseconds of each other, under NTP), so what many nodes say
arrives together, and the conductor wakes about once a tick for it rather than once a message.
On a busy machine a wake-up, with caches cold, costs the conductor 100-250 µs of CPU: more than
handling the message once it is awake.
"""

from __future__ import annotations

import math
import time

REPORT_EVERY_S = 0.1  # the ticks reports and releases go on: at most this often, and this late
SLACK_S = 0.005  # an event loop's timer may fire this much before its time (uvloop rounds to 1 ms)


def last_tick(period_s: float, at: float) -> float:
    """The last multiple of ``period_s`` at or before ``at``."""
    return math.floor(at / period_s + 1e-9) * period_s


def until_tick(period_s: float, after_s: float = 0.0, now: float | None = None) -> float:
    """Seconds from ``now`` (default: the wall clock's now) to the first multiple of ``period_s``
    that is at least ``after_s`` away."""
    now = time.time() if now is None else now
    return math.ceil((now + max(0.0, after_s)) / period_s) * period_s - now
