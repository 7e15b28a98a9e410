"""``mooncake sim size``: the smallest cluster (fewest instances; ties: fewer prefill)
whose SLO attainment reaches the target.

Attainment grows with either pool, so the minimal decode count for a prefill count,
``d(p)``, does not grow with ``p``. The search bisects for the fewest prefill
instances (with the most decode) and the fewest decode (with the most prefill),
then walks the frontier ``(p, d(p))`` as a staircase: each step one simulation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from mooncake.sim.hardware import Hardware
from mooncake.sim.results import SimResult
from mooncake.sim.setup import SimSetup
from mooncake.sim.simulator import simulate
from mooncake.sim.workload import SimRequest


@dataclass
class SizeAnswer:
    target: float
    best: tuple[int, int] | None  # (prefill, decode), None when nothing within the bounds qualifies
    frontier: list[tuple[int, int]]  # (p, the fewest decode instances that qualify with p)
    evaluated: dict[tuple[int, int], SimResult] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"target_attainment": self.target,
                "best": None if self.best is None else {"prefill": self.best[0], "decode": self.best[1]},
                "frontier": [{"prefill": p, "decode": d} for p, d in self.frontier],
                "evaluated": [{"prefill": p, "decode": d, "slo_attainment": r.slo_attainment,
                               "ttft_p90_s": r.ttft_p90_s, "tbt_p90_s": r.tbt_p90_s, "rejected": r.rejected,
                               "sim_wall_s": r.sim_wall_s} for (p, d), r in sorted(self.evaluated.items())]}


def _first(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest x in [lo, hi] with ok(x), given ok(hi) and ok monotone."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def size_cluster(requests: list[SimRequest], hw: Hardware, template: SimSetup, target: float,
                 max_prefill: int, max_decode: int,
                 progress: Callable[[SimResult], None] | None = None, full_frontier: bool = False) -> SizeAnswer:
    """``template``: policy, store use, SLOs and seed (its instance counts are ignored).
    ``full_frontier`` (for a plot): walk the frontier to its end, not only as far as a
    smaller cluster is still possible, and simulate the sizes around the answer too."""
    if not 0 < target <= 1:
        raise ValueError("the attainment target must be within (0, 1]")
    if max_prefill < 1 or max_decode < 1:
        raise ValueError("the search bounds must be >= 1")
    answer = SizeAnswer(target, None, [])

    def ok(p: int, d: int) -> bool:
        r = answer.evaluated.get((p, d))
        if r is None:
            setup = SimSetup(p, d, template.policy, template.use_store, template.ttft_slo_ms,
                             template.tbt_slo_ms, template.seed)
            r = answer.evaluated[(p, d)] = simulate(setup, hw, requests)
            if progress is not None:
                progress(r)
        return r.slo_attainment >= target

    if not ok(max_prefill, max_decode):
        return answer
    p_min = _first(1, max_prefill, lambda p: ok(p, max_decode))
    d_floor = _first(1, max_decode, lambda d: ok(max_prefill, d))
    d = _first(d_floor, max_decode, lambda d: ok(p_min, d))
    answer.frontier.append((p_min, d))
    best = (p_min, d)
    p = p_min
    while d > d_floor and p < max_prefill and (full_frontier or p + 1 + d_floor < sum(best)):
        p += 1
        while d > d_floor and ok(p, d - 1):
            d -= 1
        answer.frontier.append((p, d))
        if p + d < sum(best):
            best = (p, d)
    answer.best = best
    if full_frontier:
        bp, bd = best
        for p in range(max(1, bp - 2), min(max_prefill, bp + 2) + 1):
            for d in range(max(1, bd - 1), min(max_decode, bd + 2) + 1):
                ok(p, d)
    return answer
