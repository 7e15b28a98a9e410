"""``mooncake sim size``: the smallest cluster (fewest instances; ties: fewer prefill)
whose SLO attainment reaches the target.

Attainment grows with the decode pool (smaller batches, shorter steps), but not always
with the prefill pool: more prefill instances hand more requests to decode at once, and
their batches can then break the TBT SLO. So the search takes prefill counts in turn and
bisects, for each, the fewest decode instances that qualify, among the counts that would
still beat the best cluster found so far (one simulation rules a prefill count out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
            setup = replace(template, prefill=p, decode=d)
            r = answer.evaluated[(p, d)] = simulate(setup, hw, requests)
            if progress is not None:
                progress(r)
        return r.slo_attainment >= target

    if not ok(max_prefill, max_decode):
        return answer
    best = (max_prefill, max_decode)
    for p in range(1, max_prefill + 1):
        # a cluster with p prefill instances must have fewer instances than ``best`` (as many
        # when it has fewer prefill instances) to win; ``full_frontier`` looks a little further
        d_hi = min(max_decode, sum(best) - p - (p >= best[0]))
        if full_frontier and p <= best[0] + 4:
            d_hi = max_decode
        if d_hi < 1:
            break
        if not ok(p, d_hi):
            continue
        d = _first(1, d_hi, lambda d: ok(p, d))
        answer.frontier.append((p, d))
        if (p + d, p) < (sum(best), best[0]):
            best = (p, d)
    answer.best = best
    if full_frontier:
        bp, bd = best
        for p in range(max(1, bp - 2), min(max_prefill, bp + 2) + 1):
            for d in range(max(1, bd - 1), min(max_decode, bd + 2) + 1):
                ok(p, d)
    return answer
