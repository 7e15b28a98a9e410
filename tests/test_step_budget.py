"""A colocated step's prompt budget (``sched/colocated_budget.py``): the most prompt tokens whose predicted
step stays within the tightest TBT target of the classes decoding, from the fitted costs of the
instance's own steps, shrinking at once after a step that overran; the default target; the role
applying it with request classes (``roles/colocated.py``); the queue bound that refuses past
capacity (``sched/admission.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mooncake import protocol as P
from mooncake.config import AdmissionConfig, Config
from mooncake.metrics import Metrics
from mooncake.protocol.engine_profile import EngineProfile
from mooncake.sched.admission import Admission, Rejection
from mooncake.sched.colocated_budget import (DEFAULT_TBT_TARGET_MS, StepBudget, fit_step_tokens, prompt_budget,
                                      reachable_target_ms)
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.request_class import tbt_target_ms, tightest_target_ms

from decode_workers import Recorder, small_decode_worker

CHUNK, BLOCK = 512, 16


def test_fit_step_tokens_is_the_largest_block_multiple_within_the_target():
    for per_token in (0.0001, 0.001, 0.003, 1.0):
        step_s = lambda n: 0.05 + per_token * n  # noqa: E731
        linear = max((n for n in range(BLOCK, CHUNK + 1, BLOCK) if step_s(n) <= 0.2), default=BLOCK)
        assert fit_step_tokens(step_s, 0.2, CHUNK, BLOCK) == linear


def test_the_budget_shrinks_with_the_batch_and_on_a_slower_machine():
    prefill, decode = PrefillCostModel(tokens_per_s=3000, fixed_s=0.02), DecodeCostModel()
    target = DEFAULT_TBT_TARGET_MS / 1000
    by_batch = [prompt_budget(decode.predict(b, b * 1000), prefill, 0, target, CHUNK, BLOCK) for b in (1, 8, 16, 32)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > by_batch[-1]
    assert all(b % BLOCK == 0 and BLOCK <= b <= CHUNK for b in by_batch)
    slow = PrefillCostModel(tokens_per_s=1000, fixed_s=0.02)  # a CPU three times slower at prompts
    assert prompt_budget(decode.predict(8, 8000), slow, 0, target, CHUNK, BLOCK) < by_batch[1]
    fast = PrefillCostModel(tokens_per_s=100_000, fixed_s=0.002)  # a GPU: whole chunks fit
    assert prompt_budget(decode.predict(8, 8000), fast, 0, target, CHUNK, BLOCK) == CHUNK
    assert prompt_budget(decode.predict(8, 8000), prefill, 0, 0.0, CHUNK, BLOCK) == CHUNK  # no target
    assert prompt_budget(0.0, prefill, 0, target, CHUNK, BLOCK) == CHUNK  # nothing decodes
    assert prompt_budget(0.5, prefill, 0, target, CHUNK, BLOCK) == BLOCK  # nothing fits: a prompt still moves
    assert prompt_budget(0.5, prefill, 0, target, CHUNK, BLOCK, least=0) == 0  # ... unless it may wait (flex)


def test_a_step_that_overran_shrinks_the_next_budget_at_once_and_it_grows_back_gradually():
    truth = DecodeCostModel(), PrefillCostModel(tokens_per_s=3000, fixed_s=0.02)  # what steps really take
    budget = StepBudget(DecodeCostModel(), PrefillCostModel(tokens_per_s=3000, fixed_s=0.02), CHUNK, BLOCK)
    target = 0.2

    def step(n: int, slower: float = 1.0) -> None:
        budget.observe(8, 8000, truth[0].predict(8, 8000) * slower, n, 0, truth[1].predict(n, 0) * slower)

    before = budget.tokens(8, 8000, 0, target)
    step(before, slower=2.0)  # a step twice as slow as predicted: past the target
    assert budget.scale == pytest.approx(2.0, rel=0.2)
    after = budget.tokens(8, 8000, 0, target)
    assert after < before  # the very next step
    step(after)  # on time again
    assert after <= budget.tokens(8, 8000, 0, target) < before  # grows back, not all at once
    for _ in range(60):
        step(budget.tokens(8, 8000, 0, target))
    assert budget.tokens(8, 8000, 0, target) >= before - BLOCK


def test_targets_by_class_and_the_default_target():
    cfg = Config()
    assert tbt_target_ms(P.Sampling(), cfg, 200) == 200  # no SLO: the default
    assert tbt_target_ms(P.Sampling(request_class="flex"), cfg, 200) == 0  # flex work has none
    cfg.admission.tbt_slo_ms = 300
    cfg.classes.priority.tbt_slo_ms = 80
    assert tbt_target_ms(P.Sampling(), cfg, 200) == 300
    assert tightest_target_ms([P.Sampling(), P.Sampling(request_class="priority"), P.Sampling(request_class="flex")], cfg, 200) == 80
    assert tightest_target_ms([P.Sampling(request_class="flex")], cfg, 200) == 0
    assert reachable_target_ms(None, BLOCK) == DEFAULT_TBT_TARGET_MS
    fast = EngineProfile(prefill=[(16, 0, 0.002), (512, 0, 0.02), (512, 1024, 0.03)],
                         decode=[(1, 128, 0.003), (8, 8192, 0.01), (32, 32768, 0.03)])
    assert reachable_target_ms(fast, BLOCK) == DEFAULT_TBT_TARGET_MS
    slow = EngineProfile(prefill=[(16, 0, 0.1), (512, 0, 2.0), (512, 1024, 3.0)],
                         decode=[(1, 128, 0.1), (8, 8192, 0.3), (32, 32768, 1.0)])
    assert reachable_target_ms(slow, BLOCK) > 1.5 * 300  # a machine that cannot keep 200 ms gets one it can


@pytest.fixture()
def colocated_worker():
    yield from small_decode_worker(colocated=True)


def _request(rid: str, cls_name: str, block_tokens: int) -> P.DecodeRequest:
    tokens = list(range(100 + len(rid), 100 + len(rid) + block_tokens + 3))
    return P.DecodeRequest(rid, tokens, [], b"root", P.Sampling(max_tokens=4, request_class=cls_name), kv_token=b"k" * 16)


async def test_flex_prompts_never_keep_an_interactive_one_from_reserving(colocated_worker):
    w = colocated_worker
    w.host.send = Recorder()
    T, cap = w.host.engine.block_tokens, w.host.cfg.engine.max_prefill_batch
    for i in range(cap + 1):
        await w.handle(_request(f"flex{i}", "flex", T), [])
    assert len(w.batch.incoming) == cap and [m.req_id for m in w.batch.pending] == [f"flex{cap}"]  # flex waits its turn
    await w.handle(_request("chat", "default", T), [])
    assert "chat" in w.batch.incoming  # beside the flex prompts holding theirs
    await w.close()


def _slot(cls_name: str, num_tokens: int = 1000, prefilled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(seq=SimpleNamespace(sampling=P.Sampling(request_class=cls_name), num_tokens=num_tokens,
                                               num_computed=0, prefilled=prefilled))


async def test_the_role_sizes_each_step_by_the_classes_it_decodes(colocated_worker):
    w = colocated_worker
    chunk = w.host.cfg.engine.prefill_chunk_tokens
    chat_prompt, flex_prompt = _slot("default", 600, prefilled=False).seq, _slot("flex", 600, prefilled=False).seq
    chat_prompt.tokens = flex_prompt.tokens = list(range(600))
    assert w.host.step_target_ms == DEFAULT_TBT_TARGET_MS and w.host.step_tokens == 0
    assert w._prompt_budget([], 0, [chat_prompt]) == chunk  # nothing decodes: a whole chunk
    chat = [_slot("default") for _ in range(8)]
    eight = w._prompt_budget(chat, 8000, [chat_prompt])
    assert w.host.engine.block_tokens <= eight < chunk  # interactive rows: what keeps the step within 200 ms
    assert w._prompt_budget(chat * 3, 24000, [chat_prompt]) < eight  # more rows, smaller chunks
    assert w._prompt_budget([_slot("flex") for _ in range(8)], 8000, [chat_prompt]) == chunk  # flex rows: no target
    # a flex prompt beside interactive rows: only the flex allowance (half their step + 20 ms), a block at least
    flex_only = w._prompt_budget(chat, 8000, [flex_prompt])
    assert w.host.engine.block_tokens <= flex_only < eight
    assert w._prompt_budget(chat, 8000, [chat_prompt, flex_prompt]) == eight  # interactive chunks take the room
    assert w._prompt_budget([], 0, [flex_prompt]) == w.host.cfg.classes.flex_chunk_tokens  # flex work alone
    short = _slot("default", 600, prefilled=False).seq  # an interactive prompt with 24 tokens left to compute
    short.tokens, short.num_computed = list(range(600)), 576
    assert 24 <= w._prompt_budget([], 0, [short, flex_prompt]) < w.host.cfg.classes.flex_chunk_tokens
    w.host.cfg.classes.default.tbt_slo_ms = 400  # a class's own SLO is its target
    assert w._prompt_budget(chat, 8000, [chat_prompt]) > eight
    w.host.step_tokens = 128  # [engine] step_tokens fixes it, less a token per row
    assert w._prompt_budget(chat, 8000, [chat_prompt]) == 120
    await w.close()


def test_past_capacity_a_request_that_would_queue_too_long_is_refused_with_retry_after():
    plan = SimpleNamespace(queue_s=5.0, reserve_wait_s=0.5, best_ttft_s=6.0, est_ttft_s=6.0, est_prefill_s=0.0,
                           queue_slack_s=float("inf"), est_tbt_s=0.01, decode_batch=1, decode_drain_s=0.0)
    admission = Admission(AdmissionConfig(), Metrics())  # no SLOs: the default bound, 2 s
    admission.last_admitted = 0.0
    r = admission.check_plan(plan, now=0.0)
    assert isinstance(r, Rejection) and r.status == 429 and r.reason == "queue_wait"
    assert r.retry_after_s == pytest.approx(3.5) and "max_queue_wait_s" in r.message
    assert admission.check_plan(plan, now=0.0, evidence=(False, True)) is None  # no evidence: never refuses
    assert admission.check_plan(plan, now=0.0, limits=(0.0, 0.0, 0.0)) is None  # flex's default: waits
    plan.best_ttft_s = plan.est_ttft_s = 2.5  # a TTFT SLO judges the wait itself (3 s: admitted)
    assert admission.check_plan(plan, now=0.0, limits=(3000.0, 0.0, 2.0)) is None
    plan.queue_s = 1.0
    assert admission.check_plan(plan, now=0.0) is None  # 1.5 s of the 2 s allowed a cached prompt
    plan.est_prefill_s = 2.0  # a prompt computed from scratch: half the bound (2 * 2 / (2 + 2) = 1 s)
    r = admission.check_plan(plan, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "queue_wait" and r.retry_after_s == 1.0  # at least 1 s
