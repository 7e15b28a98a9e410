"""Cost models stay sane whatever samples arrive: adversarial sequences, monotonicity,
bounds, recovery, and seeding from a measured profile."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.sched.bounded_fit import solve_box_qp
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel


def prefill_truth(n: int, ctx: int) -> float:
    """The known cost the samples are generated from: 40 ms + 0.5 ms/token + attention."""
    return 0.04 + 0.5 * n / 1000 + 0.05 * n * (ctx + n / 2) / 1e6


def decode_truth(batch: int, kv: int) -> float:
    """20 ms + 1.5 ms per sequence + 2 ms per 1,000 KV tokens."""
    return 0.02 + 0.0015 * batch + 0.002 * kv / 1000


def at(batch: int, ctx: int = 512) -> tuple[int, int, float]:
    """A decode sample of ``batch`` sequences of ``ctx`` tokens each."""
    return batch, batch * ctx, decode_truth(batch, batch * ctx)


GRID = [(n, ctx) for n in (1, 16, 128, 1000, 4000) for ctx in (0, 1000, 4000)]
BATCHES = [1, 2, 8, 32, 128, 256]
DECODE_GRID = [(b, b * c) for b in BATCHES for c in (16, 512, 2048)]
DECODE_PROFILE = [at(1, 128), at(8, 128), at(32, 128), at(1, 1024)]
PROFILE = [(32, 0), (128, 0), (512, 0), (128, 384)]
SIZES = [16, 64, 200, 500, 1000, 2000]


def truthful(k: int) -> list[tuple[int, int, float]]:
    return [(SIZES[i % 6], (i * 300) % 1500, prefill_truth(SIZES[i % 6], (i * 300) % 1500)) for i in range(k)]


def with_outlier(first: bool) -> list[tuple[int, int, float]]:
    seq = truthful(20)
    seq.insert(0 if first else 10, (500, 0, 100 * prefill_truth(500, 0)))
    return seq


def zero_durations() -> list[tuple[int, int, float]]:
    bad = [0.0, -1.0, math.nan, math.inf, 0.0]
    return [s for i, t in enumerate(truthful(10)) for s in (t, (t[0], t[1], bad[i % 5]))]


def reversed_slope() -> list[tuple[int, int, float]]:
    """Longer prompts measured faster: durations assigned in reverse order of size."""
    sizes = [200, 300, 400, 500, 600]
    return [(n, 0, prefill_truth(m, 0)) for n, m in zip(sizes, reversed(sizes))] * 4


PREFILL_SEQUENCES = {
    "issue_tiny_first": [(2, 0, 0.05)],
    "tiny_first_then_truth": [(2, 0, 0.05)] + truthful(5),
    "outlier_first": with_outlier(first=True),
    "outlier_middle": with_outlier(first=False),
    "zero_and_bad_durations": zero_durations(),
    "identical": [(500, 0, prefill_truth(500, 0))] * 200,
    "only_short": [(n, 0, prefill_truth(n, 0)) for n in range(1, 17)] * 6,
    "reversed_slope": reversed_slope(),
    "tiny_duration": truthful(3) + [(1000, 0, 1e-9)] + truthful(3),
}


def seeded_prefill() -> PrefillCostModel:
    return PrefillCostModel.from_profile([(n, c, prefill_truth(n, c)) for n, c in PROFILE])


def within(pred: float, truth: float, factor: float) -> bool:
    return truth / factor <= pred <= truth * factor


@pytest.mark.parametrize("start", ["default_prior", "profile"])
@pytest.mark.parametrize("name", PREFILL_SEQUENCES)
def test_prefill_model_stays_within_3x_of_truth(name: str, start: str) -> None:
    m = PrefillCostModel() if start == "default_prior" else seeded_prefill()
    for n, ctx, s in PREFILL_SEQUENCES[name]:
        m.observe(n, ctx, s)
        for gn, gc in GRID:
            assert within(m.predict(gn, gc), prefill_truth(gn, gc), 3.0), (name, gn, gc, m.weights)


def test_the_issue_scenario_no_longer_predicts_a_thousand_seconds() -> None:
    m = PrefillCostModel()
    m.observe(2, 0, 0.05)
    assert m.predict(1000, 0) < 2 * PrefillCostModel().predict(1000, 0)


DECODE_SEQUENCES = {
    "tiny_first": [(1, 512, 0.5)],
    "outlier_middle": [at(b, c) for b in (1, 4, 16, 32) for c in (100, 1000)] * 2 + [(8, 4000, 5.0)]
    + [at(b, c) for b in (1, 4, 16, 32) for c in (300, 2000)],
    "zero_and_bad_durations": [x for b in (1, 8, 32) * 4 for x in (at(b), (b, 512 * b, 0.0), (b, 512 * b, math.nan))],
    "identical": [at(1)] * 200,
    "only_small": [at(b, 64) for b in (1, 2)] * 50,
    "reversed_slope": [(b, b * 512, decode_truth(c, c * 512)) for b, c in zip((4, 8, 16, 32), (32, 16, 8, 4))] * 5,
    "long_contexts": [at(b, c) for b in (2, 8) for c in (2000, 8000)] * 10,
}


@pytest.mark.parametrize("start", ["default_prior", "profile"])
@pytest.mark.parametrize("name", DECODE_SEQUENCES)
def test_decode_model_stays_within_3x_of_truth(name: str, start: str) -> None:
    m = DecodeCostModel() if start == "default_prior" else DecodeCostModel.from_profile(DECODE_PROFILE)
    for b, kv, s in DECODE_SEQUENCES[name]:
        m.observe(b, kv, s)
        for gb, gkv in DECODE_GRID:
            assert within(m.predict(gb, gkv), decode_truth(gb, gkv), 3.0), (name, gb, gkv, m.weights)


def test_seeding_from_a_profile_reproduces_the_machine() -> None:
    m = seeded_prefill()
    for n, ctx in GRID:
        assert within(m.predict(n, ctx), prefill_truth(n, ctx), 1.25), (n, ctx, m.weights)
    d = DecodeCostModel.from_profile(DECODE_PROFILE)
    for b, kv in DECODE_GRID:  # batch sizes and contexts far beyond the profile's
        assert within(d.predict(b, kv), decode_truth(b, kv), 1.05), (b, kv, d.weights)


def test_a_profile_with_nothing_usable_leaves_the_default_prior() -> None:
    assert PrefillCostModel.from_profile([]).weights == pytest.approx(PrefillCostModel().weights)
    assert PrefillCostModel.from_profile([(0, 0, 1.0), (10, 0, 0.0)]).weights == \
        pytest.approx(PrefillCostModel().weights)
    assert DecodeCostModel.from_profile([(1, 128, math.nan)]).weights == pytest.approx(DecodeCostModel().weights)


def test_follows_a_slower_machine_over_a_few_samples() -> None:
    m = seeded_prefill()
    for n, ctx, s in truthful(40):
        m.observe(n, ctx, 4 * s)  # the machine got 4x slower (contention)
    assert within(m.predict(1000, 0), 4 * prefill_truth(1000, 0), 1.15)


def test_a_fit_beyond_max_factor_is_discarded() -> None:
    m = PrefillCostModel(max_factor=10.0)
    for _ in range(100):
        m.observe(1000, 0, 1000.0)  # 3000x the prior: implausible, however often it is said
    assert m.predict(1000, 0) <= 10 * PrefillCostModel().predict(1000, 0) * 1.001
    assert m.model.rejected_fits > 0


def test_fetch_time_moves_by_a_bounded_factor_per_sample() -> None:
    m = PrefillCostModel(fetch_block_s=0.001)
    m.observe_fetch(1, 100.0)
    assert m.fetch_block_s <= 0.001 * (0.8 + 0.2 * 3) + 1e-12
    m.observe_fetch(4, 0.0)
    m.observe_fetch(0, 1.0)
    m.observe_fetch(2, math.nan)
    assert m.fetch_block_s == pytest.approx(0.001 * (0.8 + 0.2 * 3))


def test_bad_priors_are_refused() -> None:
    with pytest.raises(ValueError, match="tokens_per_s"):
        PrefillCostModel(tokens_per_s=0)
    with pytest.raises(ValueError, match=">= 0"):
        PrefillCostModel(fixed_s=-1.0)
    with pytest.raises(ValueError, match="no cost"):
        DecodeCostModel(step_s=0.0, per_seq_s=0.0, per_1k_kv_s=0.0)
    with pytest.raises(ValueError, match="max_factor"):
        DecodeCostModel(max_factor=1.0)


def test_box_qp_matches_the_unconstrained_solution_inside_the_box() -> None:
    A, b = [[2.0, 0.5], [0.5, 1.0]], [1.0, 2.0]
    t = solve_box_qp(A, b, [-10, -10], [10, 10], [0, 0])
    assert t == pytest.approx([0.0, 2.0], abs=1e-9)  # A^-1 b
    t = solve_box_qp(A, b, [0.5, 0], [10, 1.5], [0, 0])
    assert t == pytest.approx([0.5, 1.5], abs=1e-9)  # both bounds active (KKT holds there)


durations = st.one_of(st.floats(min_value=-1.0, max_value=1e6), st.floats(min_value=1e-12, max_value=10.0),
                      st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e300]))
prefill_samples = st.lists(st.tuples(st.integers(-5, 100_000), st.integers(-5, 100_000), durations), max_size=40)
decode_samples = st.lists(st.tuples(st.integers(-2, 2048), st.integers(-5, 10**6), durations), max_size=40)


@settings(max_examples=60, deadline=None)
@given(samples=prefill_samples, seeded=st.booleans(),
       pairs=st.lists(st.tuples(st.integers(0, 10**5), st.integers(0, 10**5), st.integers(0, 10**5),
                                st.integers(0, 10**5)), min_size=1, max_size=10))
def test_prefill_predictions_are_monotone_and_bounded(samples, seeded, pairs) -> None:
    m = seeded_prefill() if seeded else PrefillCostModel()
    prior = seeded_prefill() if seeded else PrefillCostModel()
    for n, ctx, s in samples:
        m.observe(n, ctx, s)
    for n, dn, ctx, dc in pairs:
        low, high = m.predict(n, ctx), m.predict(n + dn, ctx + dc)
        assert 0 <= low <= high * (1 + 1e-12) and math.isfinite(high)
    for n, ctx in PrefillCostModel.REFERENCES:
        ratio = m.predict(n, ctx) / prior.predict(n, ctx)
        assert 1 / m.model.max_factor <= ratio <= m.model.max_factor * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(samples=decode_samples, b1=st.integers(0, 4096), db=st.integers(0, 4096),
       kv1=st.integers(0, 10**6), dkv=st.integers(0, 10**6))
def test_decode_predictions_are_monotone_and_bounded(samples, b1, db, kv1, dkv) -> None:
    m = DecodeCostModel()
    for b, kv, s in samples:
        m.observe(b, kv, s)
    assert 0 < m.predict(b1, kv1) <= m.predict(b1 + db, kv1 + dkv) * (1 + 1e-12)
    for b, kv in DecodeCostModel.REFERENCES:
        assert 1 / 30 <= m.predict(b, kv) / DecodeCostModel().predict(b, kv) <= 30 * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(garbage=prefill_samples)
def test_truthful_samples_wash_out_any_garbage(garbage) -> None:
    m = seeded_prefill()
    for n, ctx, s in garbage:
        m.observe(n, ctx, s)
    for n, ctx, s in truthful(300):  # more than the window: only the truth is left in it
        m.observe(n, ctx, s)
    for n, ctx in GRID:
        assert within(m.predict(n, ctx), prefill_truth(n, ctx), 1.1), (n, ctx, m.weights)
