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


def _e2e_capacity(name: str = "e2e_capacity"):
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        return importlib.import_module(name)
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


# --- sustained replays: a workload repeated until its arrivals span a minimum time ---------------

def _blocks(tokens: tuple[int, ...], block: int) -> set[tuple[int, ...]]:
    return {tokens[i:i + block] for i in range(0, len(tokens) - block + 1, block)}


def _trace_records():
    from mooncake.bench.trace import TraceRecord

    spec = [(0, (1, 2, 3)), (100, (7, 8)), (200, (1, 2, 4)), (400, (9,)), (600, (1, 5)), (900, (7, 8, 6))]
    return [TraceRecord(line_no=i + 1, timestamp_ms=t, input_length=len(ids) * 512, output_length=3, hash_ids=ids)
            for i, (t, ids) in enumerate(spec)]


def test_trace_repetitions_span_the_minimum_at_the_same_rate_and_share_nothing_across() -> None:
    from mooncake.bench.prompts import TokenRange
    from mooncake.bench.trace import TraceScaling, trace_sessions

    rng, recs = TokenRange(1000, 30000), _trace_records()
    once = trace_sessions(recs, TraceScaling(block_tokens=4), rng)  # spans 0.9 s, 6 requests
    assert trace_sessions(recs, TraceScaling(block_tokens=4, min_span_s=0.9), rng) == once  # already long enough
    got = trace_sessions(recs, TraceScaling(block_tokens=4, min_span_s=3.0), rng)
    # period = span + one mean gap = 0.9 * 6 / 5 = 1.08 s; 3 repetitions span 2 * 1.08 + 0.9 = 3.06 s >= 3
    assert len(got) == 18 and got[-1].arrival_s == pytest.approx(3.06)
    assert (len(got) - 1) / got[-1].arrival_s == pytest.approx((len(once) - 1) / once[-1].arrival_s)  # same rate
    assert got[:6] == once  # the first repetition is the workload itself
    assert len({s.session_id for s in got}) == 18
    reps = [got[0:6], got[6:12], got[12:18]]
    for r, rep in enumerate(reps):
        assert [s.arrival_s for s in rep] == pytest.approx([s.arrival_s + r * 1.08 for s in once])
        assert [s.max_tokens for s in rep] == [s.max_tokens for s in once]
        assert [len(s.turns[0]) for s in rep] == [len(s.turns[0]) for s in once]
        for i in range(6):  # within a repetition: exactly the workload's own sharing
            for j in range(6):
                a, b, oa, ob = rep[i].turns[0], rep[j].turns[0], once[i].turns[0], once[j].turns[0]
                assert (a[:4] == b[:4]) == (oa[:4] == ob[:4]) and (a[:8] == b[:8]) == (oa[:8] == ob[:8])
    for r in (1, 2):  # across repetitions: no block in common, so no cache a repetition filled serves another
        earlier = set().union(*(_blocks(s.turns[0], 4) for rep in reps[:r] for s in rep))
        assert all(not (_blocks(s.turns[0], 4) & earlier) for s in reps[r])
        assert all(s.turns[0][0] != o.turns[0][0] for s in reps[r] for o in once)


def test_trace_repetitions_need_a_selection_with_a_span() -> None:
    from mooncake.bench.prompts import TokenRange
    from mooncake.bench.trace import TraceScaling, repetitions, trace_sessions

    with pytest.raises(ValueError, match="min_span_s must be > 0"):
        TraceScaling(min_span_s=0)
    with pytest.raises(ValueError, match="span some time"):
        trace_sessions(_trace_records()[:1], TraceScaling(block_tokens=4, min_span_s=10), TokenRange())
    assert repetitions([0.0, 1.0], None) == (1, 0.0) and repetitions([], 5.0) == (1, 0.0)
    assert repetitions([0.0, 1.0], 3.0) == (2, 2.0)  # 2 copies span 2 + 1 = 3 s exactly


def test_shared_prefix_copies_have_prefixes_of_their_own() -> None:
    from mooncake.bench.prompts import TokenRange
    from mooncake.bench.workloads import SharedPrefixSpec, shared_prefix_sessions

    rng = TokenRange(1000, 30000)
    base = dict(groups=2, sessions_per_group=2, prefix_tokens=12, suffix_tokens=3, turns=2, seed=5)
    once = shared_prefix_sessions(SharedPrefixSpec(**base), rng)
    got = shared_prefix_sessions(SharedPrefixSpec(**base, repeats=3), rng)
    assert len(got) == 12 and got[:4] == once  # copy 0 is the workload itself, copies follow in order
    assert len({s.session_id for s in got}) == 12
    for r in range(3):
        copy = got[4 * r:4 * r + 4]
        prefixes = [s.turns[0][:12] for s in copy]
        assert prefixes[0] == prefixes[2] != prefixes[1] == prefixes[3]  # g0 s0, g1 s0, g0 s1, g1 s1
        if r:
            earlier = {s.turns[0][:12] for s in got[:4 * r]}
            assert not set(prefixes) & earlier
    with pytest.raises(ValueError, match="repeats"):
        SharedPrefixSpec(repeats=0)


def test_copies_to_span_is_the_fewest_copies_on_the_runners_own_arrivals() -> None:
    from mooncake.bench.arrivals import ArrivalSpec, arrival_times, copies_to_span
    from mooncake.bench.prompts import TokenRange
    from mooncake.bench.workloads import SharedPrefixSpec, shared_prefix_sessions

    spec = ArrivalSpec(kind="poisson", rate=2.0, seed=0)
    k = copies_to_span(spec, 6, 30.0)
    times = lambda copies: arrival_times(spec, shared_prefix_sessions(  # noqa: E731
        SharedPrefixSpec(groups=2, sessions_per_group=3, repeats=copies), TokenRange()))
    assert times(k)[-1] >= 30.0 > times(k - 1)[-1]
    assert copies_to_span(ArrivalSpec(kind="rate", rate=2.0), 5, 2.0) == 1  # 5 sessions at 0.5 s: 0..2 s
    assert copies_to_span(ArrivalSpec(kind="rate", rate=2.0), 5, 2.1) == 2  # 10: 0..4.5 s
    assert copies_to_span(ArrivalSpec(kind="rate", rate=2.0), 5, 4.6) == 3  # 15: 0..7 s
    for bad in (ArrivalSpec(kind="concurrency", concurrency=2), ArrivalSpec(kind="trace")):
        with pytest.raises(ValueError, match="generated arrivals"):
            copies_to_span(bad, 4, 10.0)
    with pytest.raises(ValueError, match="more than 10 sessions"):
        copies_to_span(ArrivalSpec(kind="rate", rate=1.0), 5, 100.0, limit=10)


def test_bench_e2e_workloads_are_unchanged_by_default_and_sustained_on_request() -> None:
    from mooncake.bench.arrivals import copies_to_span

    bench_e2e = _e2e_capacity("bench_e2e")

    plain = bench_e2e.workloads(False, "/tokenizer", 4.0, salt=2)
    assert plain["trace"]["max_requests"] == 69 and plain["trace"]["scaling"].min_span_s is None
    assert plain["shared-prefix"]["shared_prefix"].repeats == 1
    sus = bench_e2e.workloads(False, "/tokenizer", 4.0, salt=2, min_arrival_s=120.0)
    assert sus["trace"]["max_requests"] is None  # the runner must not cut the repetitions
    assert sus["trace"]["scaling"].min_span_s == 120.0 and sus["trace"]["scaling"].max_requests == 69
    sp = sus["shared-prefix"]
    assert sp["shared_prefix"].repeats == copies_to_span(sp["arrival"], 12, 120.0) > 1


def test_slo_misses_names_each_cause_and_the_queue_growth(tmp_path) -> None:
    import json

    mod = _e2e_capacity("slo_misses")

    def rec(start: float, ttft: float, e2e: float, tokens: int, ok: bool = True) -> dict:
        return {"start_s": start, "ok": ok, "ttft_s": ttft if ok else None, "e2e_s": e2e if ok else None,
                "completion_tokens": tokens}

    records = [rec(0, 0.1, 1.0, 10), rec(1, 0.2, 5.2, 11),   # good; TPOT 0.5 s
               rec(2, 4.0, 4.5, 6), rec(3, 5.0, 9.0, 5),     # TTFT only; both (TPOT 1 s)
               rec(4, 0, 0, 0, ok=False), rec(5, 2.0, 2.0, 1),  # failed; one token: TPOT counts as 0
               rec(6, 2.5, 2.7, 2), rec(7, 2.9, 3.0, 2)]     # good, good
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"records": records}))
    assert mod.row(path, 3000.0, 300.0) == f"| {tmp_path.name}/run | 4 / 8 | 1 | 1 | 1 | 1 | 150 / 2700 |"
