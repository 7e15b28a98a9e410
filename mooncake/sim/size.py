"""``mooncake sim size``: the smallest cluster (fewest instances; ties: fewer prefill)
whose SLO attainment reaches the target, disaggregated and, where asked, colocated (the
fewest colocated instances alone), and which of the two designs needs fewer.

Attainment grows with the decode pool (smaller batches, shorter steps), but not always
with the prefill pool: more prefill instances hand more requests to decode at once, and
their batches can then break the TBT SLO. So the search takes prefill counts in turn and
bisects, for each, the fewest decode instances that qualify, among the counts that would
still beat the best cluster found so far (one simulation rules a prefill count out).
Attainment grows with the number of colocated instances, so that count is bisected, for
each step budget of ``budget_ladder`` in turn (or the one asked for) among the counts that
would beat the best found so far: a tight TBT SLO wants small steps, a tight TTFT SLO large ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from mooncake.sim.colocated_steps import budget_ladder
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
    colocated: int | None = None  # the fewest colocated instances that qualify (None: none within the bound)
    colocated_step_tokens: int = 0  # the step budget they run (the first that qualified with the fewest)
    colocated_evaluated: dict[tuple[int, int], SimResult] = field(default_factory=dict)  # (instances, step
    # tokens); empty: not searched

    def designs(self) -> dict:
        """Instances each design needs (None: none within the bounds), which needs fewer
        ("tie" when equal, None when neither qualifies), and by how many and what factor."""
        counts = {"disaggregated": sum(self.best) if self.best else None, "colocated": self.colocated}
        found = {k: v for k, v in counts.items() if v is not None}
        fewer = min(found, key=found.__getitem__) if found else None
        if len(found) == 2 and counts["disaggregated"] == counts["colocated"]:
            fewer = "tie"
        both = len(found) == 2
        return {**counts, "fewer": fewer,
                "saved_instances": abs(counts["disaggregated"] - counts["colocated"]) if both else None,
                "ratio": max(found.values()) / min(found.values()) if both else None}

    def verdict(self) -> str:
        """``designs()`` in words."""
        d = self.designs()
        if d["fewer"] is None:
            return "neither design qualifies within the bounds"
        if d["fewer"] == "tie":
            return f"both designs need {d['colocated']} instances"
        other = "disaggregated" if d["fewer"] == "colocated" else "colocated"
        if d[other] is None:
            return f"{d['fewer']} needs {d[d['fewer']]} instances; {other}: none within the bounds"
        n = d["saved_instances"]
        return f"{d['fewer']} needs {n} fewer instance{'s' * (n != 1)}: {d[d['fewer']]} vs {d[other]}"

    def to_dict(self) -> dict:
        out = {"target_attainment": self.target,
               "best": None if self.best is None else {"prefill": self.best[0], "decode": self.best[1]},
               "frontier": [{"prefill": p, "decode": d} for p, d in self.frontier],
               "evaluated": [_row(r, prefill=p, decode=d) for (p, d), r in sorted(self.evaluated.items())]}
        if self.colocated_evaluated:
            out["colocated"] = {"best": self.colocated, "step_tokens": self.colocated_step_tokens or None,
                                "evaluated": [_row(r, colocated=n, step_tokens=b)
                                              for (n, b), r in sorted(self.colocated_evaluated.items())]}
            out["designs"] = self.designs()
        return out


def _row(r: SimResult, **size: int) -> dict:
    return {**size, "slo_attainment": r.slo_attainment, "ttft_p90_s": r.ttft_p90_s, "tbt_p90_s": r.tbt_p90_s,
            "rejected": r.rejected, "sim_wall_s": r.sim_wall_s}


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
                 progress: Callable[[SimResult], None] | None = None, full_frontier: bool = False,
                 max_colocated: int = 0) -> SizeAnswer:
    """``template``: policy, store use, SLOs, seed and step tokens (its instance counts are
    ignored). ``full_frontier`` (for a plot): walk the frontier to its end, not only as far as a
    smaller cluster is still possible, and simulate the sizes around the answers too.
    ``max_colocated``: size the colocated design too, up to that many instances (0: not)."""
    if not 0 < target <= 1:
        raise ValueError("the attainment target must be within (0, 1]")
    if max_prefill < 1 or max_decode < 1 or max_colocated < 0:
        raise ValueError("the search bounds must be >= 1 (the colocated one >= 0)")
    answer = SizeAnswer(target, None, [])
    if max_colocated:
        _size_colocated(answer, requests, hw, template, max_colocated, progress, full_frontier)
    _size_disaggregated(answer, requests, hw, template, max_prefill, max_decode, progress, full_frontier)
    return answer


def _meets(answer: SizeAnswer, evaluated: dict, key: tuple[int, int], setup: SimSetup, hw: Hardware,
           requests: list[SimRequest], progress: Callable[[SimResult], None] | None) -> bool:
    """Whether ``setup`` meets the attainment target, simulated once per ``key`` (kept in ``evaluated``)."""
    r = evaluated.get(key)
    if r is None:
        r = evaluated[key] = simulate(setup, hw, requests)
        if progress is not None:
            progress(r)
    return r.slo_attainment >= answer.target


def _size_colocated(answer: SizeAnswer, requests: list[SimRequest], hw: Hardware, template: SimSetup,
                    max_colocated: int, progress: Callable[[SimResult], None] | None, around: bool) -> None:
    def ok(n: int, budget: int) -> bool:
        setup = replace(template, prefill=0, decode=0, colocated=n, step_tokens=budget)
        return _meets(answer, answer.colocated_evaluated, (n, budget), setup, hw, requests, progress)

    for budget in [template.step_tokens] if template.step_tokens else budget_ladder(hw, template.tbt_slo_ms):
        hi = max_colocated if answer.colocated is None else answer.colocated - 1
        if hi >= 1 and ok(hi, budget):
            answer.colocated = _first(1, hi, lambda n: ok(n, budget))
            answer.colocated_step_tokens = budget
    if around and answer.colocated is not None:
        for n in range(max(1, answer.colocated - 2), min(max_colocated, answer.colocated + 2) + 1):
            ok(n, answer.colocated_step_tokens)


def _size_disaggregated(answer: SizeAnswer, requests: list[SimRequest], hw: Hardware, template: SimSetup,
                        max_prefill: int, max_decode: int, progress: Callable[[SimResult], None] | None,
                        full_frontier: bool) -> None:
    def ok(p: int, d: int) -> bool:
        setup = replace(template, prefill=p, decode=d, colocated=0)
        return _meets(answer, answer.evaluated, (p, d), setup, hw, requests, progress)

    if not ok(max_prefill, max_decode):
        return
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
