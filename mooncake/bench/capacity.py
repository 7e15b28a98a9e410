"""Capacity search: the highest arrival-rate scale at which enough requests meet the SLO.

A system's capacity is the highest arrival rate at which at least ``target`` (90%) of
the requests meet every SLO (attainment). :func:`search_capacity` finds it from a
``measure(scale) -> attainment`` callback, where ``scale`` multiplies a workload's own
arrival rate:

1. geometric steps up from ``start`` (× ``growth``) until attainment falls below the
   target or the cap ``max_scale`` is reached (then the capacity is only a lower bound:
   ``capped``);
2. if the very first scale fails, geometric steps down to ``min_scale`` instead;
3. a bounded bisection (geometric midpoints) between the last passing and the first
   failing scale.

Every rate is measured at most once and at most ``max_rates`` rates are measured in
all. With a noisy, non-monotone curve the result is the last passing scale below the
lowest failing one seen: a pass above a failure is never searched for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class CapacityPlan:
    """Bounds of a search, in multiples of the workload's own arrival rate."""

    start: float = 1.0
    growth: float = 2.0
    target: float = 0.9
    """Attainment (fraction of requests within the SLO) a rate must reach to pass."""
    max_scale: float = 16.0
    min_scale: float = 0.25
    max_rates: int = 8
    """Rates measured in all (steps up or down, then bisection)."""
    bisect_steps: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.min_scale <= self.start <= self.max_scale:
            raise ValueError("need 0 < min_scale <= start <= max_scale")
        if not self.growth > 1:
            raise ValueError("growth must be > 1")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")
        if self.max_rates < 1 or self.bisect_steps < 0:
            raise ValueError("max_rates must be >= 1 and bisect_steps >= 0")


@dataclass
class CapacityResult:
    """What a search measured and concluded."""

    trials: list[tuple[float, float]] = field(default_factory=list)
    """(scale, attainment) in the order measured."""
    capacity: float | None = None
    """Highest passing scale below the first failing one; None when no scale passed."""
    first_fail: float | None = None
    """Lowest failing scale measured (the capacity lies below it); None if none failed."""
    capped: bool = False
    """True when no measured scale failed (``max_scale`` or ``max_rates`` reached): the
    capacity is at least ``capacity``, its true value was not bracketed."""


def search_capacity(measure: Callable[[float], float], plan: CapacityPlan = CapacityPlan()) -> CapacityResult:
    """Search the capacity with ``measure(scale) -> attainment in [0, 1]`` (see module doc)."""
    result = CapacityResult()

    def passes(scale: float) -> bool:
        attainment = float(measure(scale))
        if not 0.0 <= attainment <= 1.0:
            raise ValueError(f"attainment must be in [0, 1], got {attainment} at scale {scale}")
        result.trials.append((scale, attainment))
        return attainment >= plan.target

    lo: float | None = None
    hi: float | None = None
    scale = plan.start
    if passes(scale):  # up until a failure or the cap
        lo = scale
        while len(result.trials) < plan.max_rates:
            if scale >= plan.max_scale:
                break
            scale = min(scale * plan.growth, plan.max_scale)
            if not passes(scale):
                hi = scale
                break
            lo = scale
    else:  # down until a pass or the floor
        hi = scale
        while len(result.trials) < plan.max_rates and scale > plan.min_scale:
            scale = max(scale / plan.growth, plan.min_scale)
            if passes(scale):
                lo = scale
                break
            hi = scale
    if lo is not None and hi is not None:
        for _ in range(plan.bisect_steps):
            if len(result.trials) >= plan.max_rates:
                break
            mid = math.sqrt(lo * hi)
            if passes(mid):
                lo = mid
            else:
                hi = mid
    result.capacity, result.first_fail = lo, hi
    result.capped = lo is not None and hi is None
    return result


def attainment(summary: dict) -> float:
    """Fraction of a run's requests (failed ones included) that met every SLO."""
    total = summary.get("requests") or 0
    good = summary.get("good_requests") or 0
    return good / total if total else 0.0
