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
    assert spec.rate is not None
    if spec.kind == "rate":
        return [i / spec.rate for i in range(n)]
    gaps = np.random.default_rng(spec.seed).exponential(1.0 / spec.rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
