"""When each session starts: trace timestamps, fixed rate, Poisson, or closed loop.

``concurrency`` is a closed loop: every session is due at once and the
runner's concurrency limit admits them as earlier ones finish. The other
kinds are open loops (sessions start on schedule, whatever is in flight),
optionally capped by a concurrency limit too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from mooncake.bench.workloads import Session

ArrivalKind = Literal["trace", "rate", "poisson", "concurrency"]
ARRIVAL_KINDS: tuple[str, ...] = ("trace", "rate", "poisson", "concurrency")


@dataclass(frozen=True)
class ArrivalSpec:
    """Arrival process of sessions (a multi-turn session's later turns follow its answers)."""

    kind: ArrivalKind = "trace"
    rate: float | None = None
    """Sessions per second, for ``rate`` and ``poisson``."""
    concurrency: int | None = None
    """Most requests in flight; required for ``concurrency``, an optional cap otherwise."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrival kind must be one of {ARRIVAL_KINDS}, got {self.kind!r}")
        if self.kind in ("rate", "poisson") and (self.rate is None or not self.rate > 0):
            raise ValueError(f"arrival {self.kind!r} needs a rate > 0")
        if self.kind == "concurrency" and self.concurrency is None:
            raise ValueError("arrival 'concurrency' needs a concurrency >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")


def arrival_times(spec: ArrivalSpec, sessions: list[Session]) -> list[float]:
    """Start offset (s) of each session, non-decreasing, the first at 0 for generated kinds."""
    n = len(sessions)
    if spec.kind == "trace":
        missing = [s.session_id for s in sessions if s.arrival_s is None]
        if missing:
            raise ValueError(f"arrival 'trace' needs timestamps; {missing[0]} has none")
        return [float(s.arrival_s) for s in sessions]  # type: ignore[arg-type]
    if spec.kind == "concurrency":
        return [0.0] * n
    return _generated_times(spec, n)


def _generated_times(spec: ArrivalSpec, n: int) -> list[float]:
    """``rate`` / ``poisson`` start offsets of ``n`` sessions."""
    assert spec.rate is not None
    if spec.kind == "rate":
        return [i / spec.rate for i in range(n)]
    gaps = np.random.default_rng(spec.seed).exponential(1.0 / spec.rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def copies_to_span(spec: ArrivalSpec, sessions_per_copy: int, min_span_s: float, limit: int = 100_000) -> int:
    """The fewest copies of a workload of ``sessions_per_copy`` sessions whose generated
    arrivals (``rate`` or ``poisson``; the same seed, so the times of ``k`` copies are those
    the runner will draw) span at least ``min_span_s`` seconds."""
    if spec.kind not in ("rate", "poisson"):
        raise ValueError(f"a span needs generated arrivals ('rate' or 'poisson'), not {spec.kind!r}")
    if sessions_per_copy < 1 or not min_span_s > 0:
        raise ValueError("need sessions_per_copy >= 1 and min_span_s > 0")
    copies = 1
    while True:
        n = copies * sessions_per_copy
        if _generated_times(spec, n)[-1] >= min_span_s:
            return copies
        if n >= limit:
            raise ValueError(f"{min_span_s} s of arrivals needs more than {limit} sessions")
        copies += 1
