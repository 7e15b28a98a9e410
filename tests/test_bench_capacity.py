"""Capacity search on synthetic attainment curves (no servers)."""

from __future__ import annotations

import math

import pytest

from mooncake.bench.capacity import CapacityPlan, attainment, search_capacity


def curve(knee: float):
    """Monotone: every request meets the SLO up to ``knee``, then attainment falls off
    linearly, crossing the 90% target at ``knee + 0.1``."""
    return lambda scale: 1.0 if scale <= knee else max(0.0, 1.0 - (scale - knee))


def test_monotone_curve_is_bracketed_and_bisected() -> None:
    result = search_capacity(curve(5.0), CapacityPlan(bisect_steps=2))
    scales = [s for s, _ in result.trials]
    assert scales[:4] == [1.0, 2.0, 4.0, 8.0]  # geometric up to the first failure
    assert math.isclose(scales[4], math.sqrt(32))  # geometric midpoint of 4 and 8 (fails: above the knee)
    assert len(scales) == 6 and not result.capped
    assert result.capacity is not None and result.first_fail is not None
    assert result.capacity <= 5.1 < result.first_fail  # the 90% crossing lies in the final bracket
    assert 4.0 <= result.capacity and result.first_fail <= 8.0


def test_bisection_converges_toward_the_knee() -> None:
    plan = CapacityPlan(bisect_steps=6, max_rates=20)
    result = search_capacity(curve(5.0), plan)
    assert result.capacity <= 5.1 < result.first_fail
    assert result.first_fail / result.capacity < 2 ** (1 / 2 ** 5)  # bracket halves (in log) per step


def test_noisy_non_monotone_curve_stops_at_first_failure() -> None:
    noisy = {1.0: 0.95, 2.0: 0.85, 4.0: 0.97, 8.0: 0.2}  # a dip at 2x, a recovery at 4x
    seen = []

    def measure(scale: float) -> float:
        seen.append(scale)
        return noisy.get(scale, 0.93 if scale < 2 else 0.5)

    result = search_capacity(measure, CapacityPlan(bisect_steps=1))
    assert seen == [1.0, 2.0, math.sqrt(2.0)]  # never looks above the first failure
    assert result.capacity == pytest.approx(math.sqrt(2.0)) and result.first_fail == 2.0
    assert not result.capped


def test_never_passing_steps_down_to_the_floor() -> None:
    result = search_capacity(lambda s: 0.1, CapacityPlan(min_scale=0.25))
    assert [s for s, _ in result.trials] == [1.0, 0.5, 0.25]
    assert result.capacity is None and result.first_fail == 0.25 and not result.capped


def test_failing_start_steps_down_then_bisects() -> None:
    result = search_capacity(curve(0.6), CapacityPlan(bisect_steps=1))
    scales = [s for s, _ in result.trials]
    assert scales == [1.0, 0.5, math.sqrt(0.5)]
    assert result.capacity == 0.5 and result.first_fail == pytest.approx(math.sqrt(0.5))


def test_always_passing_stops_at_the_cap() -> None:
    result = search_capacity(lambda s: 1.0, CapacityPlan(max_scale=6.0))
    assert [s for s, _ in result.trials] == [1.0, 2.0, 4.0, 6.0]  # the last step is clipped to the cap
    assert result.capacity == 6.0 and result.first_fail is None and result.capped


def test_rate_budget_bounds_every_phase() -> None:
    result = search_capacity(lambda s: 1.0, CapacityPlan(max_scale=1000.0, max_rates=3))
    assert len(result.trials) == 3 and result.capacity == 4.0 and result.capped
    result = search_capacity(curve(5.0), CapacityPlan(max_rates=5, bisect_steps=3))
    assert len(result.trials) == 5  # 1, 2, 4, 8 and one bisection step only


def test_exact_target_passes() -> None:
    result = search_capacity(lambda s: 0.9 if s <= 2 else 0.0, CapacityPlan(bisect_steps=0))
    assert result.capacity == 2.0 and result.first_fail == 4.0


def test_out_of_range_attainment_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"attainment must be in \[0, 1\]"):
        search_capacity(lambda s: 1.5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(start=0.1, min_scale=0.25), "min_scale <= start"),
    (dict(start=32.0), "start <= max_scale"),
    (dict(growth=1.0), "growth"),
    (dict(target=0.0), "target"),
    (dict(max_rates=0), "max_rates"),
    (dict(bisect_steps=-1), "bisect_steps"),
])
def test_bad_plans_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CapacityPlan(**kwargs)


def test_attainment_counts_failed_requests() -> None:
    assert attainment({"requests": 10, "good_requests": 9}) == 0.9
    assert attainment({"requests": 0, "good_requests": None}) == 0.0
    assert attainment({"requests": 4, "good_requests": None}) == 0.0


def _e2e_capacity():
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        return importlib.import_module("e2e_capacity")
    finally:
        sys.path.pop(0)


def test_benchmark_glue_salts_every_replay_and_reports_every_rate() -> None:
    """bench_e2e --capacity's driver with a fake system: every replay gets a fresh salt, the
    report scales missed by the search are run after it, the tables name every rate."""
    from mooncake.bench import ArrivalSpec, SharedPrefixSpec

    mod = _e2e_capacity()
    salts_seen: list[int] = []

    def make(scale: float, salt: int) -> dict:
        return dict(workload="shared-prefix", shared_prefix=SharedPrefixSpec(turns=2, seed=salt),
                    arrival=ArrivalSpec(kind="poisson", rate=0.5 * scale, seed=0))

    def run_one(kw: dict, tag: str) -> dict:
        salts_seen.append(kw["shared_prefix"].seed)
        rate = kw["arrival"].rate
        good = 10 if rate <= 0.75 else 3  # the fake system keeps up to 1.5x
        stats = {"median": 1.0, "p99": 2.0}
        return {"requests": 10, "good_requests": good, "goodput": good / 10, "request_throughput": 1.0,
                "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats}

    import itertools
    res = mod.capacity_of("cache_aware", "shared-prefix", make, run_one,
                          CapacityPlan(bisect_steps=1), [1.0, 2.0, 4.0], itertools.count(1))
    assert res["own_rate"] == 1.0  # 0.5 conversations/s x 2 turns
    assert res["order"] == [1.0, 2.0, math.sqrt(2.0)]
    assert sorted(res["runs"]) == [1.0, math.sqrt(2.0), 2.0, 4.0]  # 4x run after the search
    assert salts_seen == [1, 2, 3, 4]  # a fresh salt per replay
    assert res["capacity"] == pytest.approx(math.sqrt(2.0)) and res["first_fail"] == 2.0
    peer = dict(res, system="llama_server", capacity=math.sqrt(2.0) / 2)
    table = mod.capacity_table([res, peer], [1.0, 2.0, 4.0])
    assert "| shared-prefix | cache_aware | 1.000 | 1.41 | 1.414 | 2.00 | 1.000 | 0.300 | 0.300 | 2.00x |" in table
    assert mod.runs_table(res).count("\n| ") == 5  # header + 4 rates
