"""Units of the conductor's planning side: KV index, cost models, hot blocks, scheduler."""

from __future__ import annotations

import random

import pytest

from mooncake.config import AdmissionConfig, ConductorConfig
from mooncake.sched.admission import Admission, Rejection
from mooncake.metrics import Metrics
from mooncake.protocol import NodeInfo
from mooncake.sched.booking import DecodeSlots, PrefillQueue
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.hot_blocks import HotBlocks
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.plan import Plan
from mooncake.sched.scheduler import Scheduler

H = [bytes([i]) * 32 for i in range(10)]


def test_prefix_runs_count_leading_blocks_per_node_and_store_coverage():
    idx = KVIndex()
    idx.add("p0", "device", H[:4])
    idx.add("p1", "device", H[1:6])  # no block 0: no run
    idx.add("s0", "dram", H[:2])
    idx.add("s1", "lmdb", H[2:5])
    runs, store_end = idx.prefix_runs(H, stores={"s0", "s1"})
    assert runs.get("p0") == 4 and "p1" not in runs
    assert store_end == 5  # s0 then s1 together
    assert idx.covering_run(H, 0, {"s0", "s1"}) == [(0, 2, "s0"), (2, 5, "s1")]
    assert idx.covering_run(H, 3, {"s0", "s1"}) == [(3, 5, "s1")]


def test_prefix_runs_agree_with_a_block_by_block_walk():
    """Runs with gaps, several stores taking turns, nodes that start and stop anywhere."""
    rng = random.Random(7)
    chain = [bytes([i, 1]) * 16 for i in range(60)]
    stores = {"s0", "s1", "s2"}
    for _ in range(200):
        idx = KVIndex()
        for node in ("p0", "p1", "s0", "s1", "s2"):
            lo = rng.choice([0, 0, rng.randrange(60)])
            idx.add(node, "t", [h for h in chain[lo:rng.randrange(lo, 61)] if rng.random() < 0.95])
        want_runs: dict[str, int] = {}
        for node in ("p0", "p1", "s0", "s1", "s2"):
            n = 0
            while n < len(chain) and node in idx.holders(chain[n]):
                n += 1
            if n:
                want_runs[node] = n
        want_store = 0
        while want_store < len(chain) and stores & set(idx.holders(chain[want_store])):
            want_store += 1
        assert idx.prefix_runs(chain, stores) == (want_runs, want_store)
        for start in (0, want_store // 2):  # the runs found by the walk stand in for re-walking
            for prefer in ((), ("s2",)):
                assert idx.covering_run(chain[:want_store], start, stores, prefer, want_runs) == \
                    idx.covering_run(chain[:want_store], start, stores, prefer)
    assert KVIndex().prefix_runs([], stores) == ({}, 0)


def test_index_remove_and_drop_node_keep_it_consistent():
    idx = KVIndex()
    idx.add("a", "device", H[:3])
    idx.add("b", "dram", H[:3])
    idx.remove("a", [H[0]])
    assert idx.holders(H[0]) == {"b": "dram"}
    assert idx.drop_node("b") == 3
    assert idx.holders(H[0]) == {} and len(idx) == 2
    assert idx.blocks_of("a") == 2


def test_hot_blocks_use_a_sliding_window():
    hot = HotBlocks(threshold=3, window_s=10)
    assert hot.hit([H[0], H[1]], now=0) == []
    assert hot.hit([H[0]], now=1) == []
    assert hot.hit([H[0], H[1]], now=2) == [H[0]]
    assert hot.hit([H[1]], now=11) == []  # the hits at t=0 left the window: H[1] has 2 (t=2, 11)
    assert hot.count(H[0]) == 2 and hot.count(H[1]) == 2
    assert hot.hit([H[1]], now=12) == [H[1]]


def test_cost_models_start_from_priors_and_follow_measurements():
    pc = PrefillCostModel(tokens_per_s=1000, fixed_s=0.0)
    assert pc.predict(1000, 0) == pytest.approx(1.0, rel=0.05)
    for n in (200, 400, 800, 1600) * 10:  # the machine is 4x slower than the prior
        pc.observe(n, 0, 4 * n / 1000)
    assert pc.predict(1000, 0) == pytest.approx(4.0, rel=0.15)
    dc = DecodeCostModel(step_s=0.01, per_seq_s=0.001, per_1k_kv_s=0.0)
    for b in (1, 8, 16, 32) * 10:  # the machine: 20 ms + 2 ms per sequence + 3 ms per 1,000 KV tokens
        for ctx in (500, 1500):
            dc.observe(b, b * ctx, 0.02 + 0.002 * b + 0.003 * b * ctx / 1000)
    assert dc.predict(20, 20_000) == pytest.approx(0.12, rel=0.1)


def node(node_id: str, role: str, machine: str, **endpoints: str) -> Node:
    return Node(node_id, role, node_id.encode(), endpoints, NodeInfo(machine, 1), 0.0)


def make(policy: str = "cache_aware", **kw) -> tuple[Scheduler, Cluster, KVIndex]:
    cfg = ConductorConfig(policy=policy, **kw)
    cluster, idx = Cluster(), KVIndex()
    for i in range(2):
        cluster.upsert(node(f"p{i}", "prefill", f"n{i}"))
        cluster.upsert(node(f"s{i}", "store", f"n{i}", store=f"tcp://s{i}"))
    cluster.upsert(node("d0", "decode", "n0", kv="tcp://d0"))
    return Scheduler(cfg, cluster, idx, PrefillCostModel(), DecodeCostModel()), cluster, idx


def test_cache_aware_prefers_the_instance_holding_the_prefix():
    sched, cluster, idx = make()
    idx.add("p1", "device", H[:8])
    plan = sched.plan(H[:8], n_tokens=8 * 16 + 5, max_tokens=4, block_tokens=16, now=0)
    assert isinstance(plan, Plan) and plan.prefill.node_id == "p1" and plan.device_blocks == 8 and not plan.fetch


def test_store_blocks_are_fetched_from_the_readers_local_store_first():
    sched, cluster, idx = make()
    idx.add("s0", "dram", H[:6])
    idx.add("s1", "dram", H[:6])
    sched.queues["p0"] = PrefillQueue()
    sched.queues["p0"].add("busy", 5.0)  # p0 is loaded: p1 wins and reads from s1, its local store
    plan = sched.plan(H[:6], n_tokens=6 * 16 + 1, max_tokens=4, block_tokens=16, now=0)
    assert isinstance(plan, Plan) and plan.prefill.node_id == "p1"
    assert [(f.start, f.end, f.endpoint) for f in plan.fetch] == [(0, 6, "tcp://s1")]


def test_the_stores_a_plan_uses_follow_membership_changes():
    """The scheduler keeps its view of the stores between plans: a store that leaves, joins
    or stops taking work is seen by the next plan."""
    sched, cluster, idx = make()
    idx.add("p1", "device", H[:6])  # p1 wins: its new blocks go to s1, its machine's store
    plan = sched.plan(H[:6], n_tokens=6 * 16 + 1, max_tokens=4, block_tokens=16, now=0)
    assert plan is not None and plan.prefill.node_id == "p1" and plan.store_endpoint == "tcp://s1"
    cluster.remove("s1")
    plan = sched.plan(H[:6], n_tokens=6 * 16 + 1, max_tokens=4, block_tokens=16, now=0)
    assert plan is not None and plan.store_endpoint == "tcp://s0"  # no local store: any store
    cluster.upsert(node("s2", "store", "n1", store="tcp://s2"))
    idx.add("s2", "dram", H[:6])
    idx.drop_node("p1")
    plan = sched.plan(H[:6], n_tokens=6 * 16 + 1, max_tokens=4, block_tokens=16, now=0)
    assert plan is not None and plan.store_endpoint in ("tcp://s0", "tcp://s2")
    assert [f.endpoint for f in plan.fetch] == ["tcp://s2"]
    cluster.nodes["s2"].draining = True
    cluster.reindex()
    plan = sched.plan(H[:6], n_tokens=6 * 16 + 1, max_tokens=4, block_tokens=16, now=0)
    assert plan is not None and plan.store_endpoint == "tcp://s0" and not plan.fetch


def test_at_least_one_prompt_token_is_left_to_compute():
    sched, _, idx = make()
    idx.add("p0", "device", H[:4])
    plan = sched.plan(H[:4], n_tokens=64, max_tokens=4, block_tokens=16, now=0)
    assert isinstance(plan, Plan) and plan.reusable_blocks == 3


def test_round_robin_alternates_whatever_the_cache():
    sched, _, idx = make("round_robin")
    idx.add("p0", "device", H[:8])
    chosen = [sched.plan(H[:8], 200, 4, 16, now=0).prefill.node_id for _ in range(4)]
    assert chosen == ["p0", "p1", "p0", "p1"]


def test_ttft_slo_rejects_when_the_queues_are_too_long():
    sched, cluster, _ = make()
    admission = Admission(AdmissionConfig(ttft_slo_ms=1000), Metrics())
    assert admission.check_plan(sched.plan(H[:2], 40, 4, 16, now=0), now=0.0) is None
    for p in cluster.of_role("prefill"):
        sched.book(f"queued-{p.node_id}", sched.plan(H[:2], 40, 4, 16, now=0))
        sched.queues[p.node_id].add(f"queued-{p.node_id}", 2.0)
    r = admission.check_plan(sched.plan(H[:2], 40, 4, 16, now=0), now=0.0)
    assert isinstance(r, Rejection) and r.status == 429 and r.reason == "ttft_slo" and r.retry_after_s >= 1


def test_tbt_slo_uses_the_batch_expected_when_prefill_finishes():
    sched, cluster, _ = make()  # prior: 30 ms + 2 ms per sequence -> 5 sequences fit in 40 ms
    admission = Admission(AdmissionConfig(tbt_slo_ms=40), Metrics())
    admission.last_admitted = 0.0  # something was admitted just now: no probe is due
    plan = sched.plan(H[:2], 40, 4, 16, now=0)
    for i in range(6):  # all still running at first-token time
        sched.book(f"r{i}", plan)
        sched.interactive_slots["d0"].add(f"r{i}", 100.0)
    r = admission.check_plan(sched.plan(H[:2], 40, 4, 16, now=0), now=0.0)
    assert isinstance(r, Rejection) and r.reason == "tbt_slo"
    for i in range(6):  # they end before this request's prefill does
        sched.interactive_slots["d0"].add(f"r{i}", 0.001)
    assert admission.check_plan(sched.plan(H[:2], 40, 4, 16, now=0), now=0.0) is None


def test_booking_is_released_by_the_scheduler():
    sched, _, _ = make()
    plan = sched.plan(H[:2], 40, 4, 16, now=0)
    sched.book("r", plan)
    assert sched.queued(plan.prefill.node_id) == 1 and sched.assigned("d0") == 1 and sched.waiting() == 1
    sched.prefill_finished("r")
    assert sched.waiting() == 0 and sched.queue_s(plan.prefill.node_id) == 0 and sched.assigned("d0") == 1
    sched.release("r")
    assert sched.assigned("d0") == 0
    sched.release("r")  # idempotent


def test_an_interactive_plan_counts_no_flex_booking_on_decode_nor_blocks_flex_work_will_compute():
    from mooncake.sched.request_class import FLEX_RANK

    sched, _, _ = make()
    n = 8 * 16 + 4
    sched.book("flex", sched.plan(H[:8], n, 4, 16, now=0, rank=FLEX_RANK), rank=FLEX_RANK)
    chat = sched.plan(H[:8], n, 4, 16, now=0)  # the same prompt: the flex request computes it later
    assert chat.device_blocks == chat.reusable_blocks == 0 and chat.decode_batch == 1
    sched.book("chat", chat)
    later = sched.plan(H[:8], n, 4, 16, now=0, rank=FLEX_RANK)  # flex work counts all that is booked
    assert later.decode_batch == 3
    assert sched.plan(H[:8], n, 4, 16, now=0).decode_batch == 2
    sched.release("flex"), sched.release("chat")
    assert sched.assigned("d0") == 0 and not sched.interactive_slots["d0"].assigned


def test_no_workers_and_overload_are_503():
    sched, cluster, _ = make()
    cluster.remove("d0")
    r = Admission(AdmissionConfig(), Metrics()).check_plan(sched.plan(H[:1], 20, 4, 16, now=0), now=0.0)
    assert isinstance(r, Rejection) and r.status == 503 and r.reason == "no_workers"


def test_admission_needs_evidence_probes_after_a_while_and_bounds_retry_after():
    sched, cluster, _ = make()
    metrics = Metrics()
    admission = Admission(AdmissionConfig(ttft_slo_ms=1000, probe_after_s=5, max_retry_after_s=30), metrics)
    plan = sched.plan(H[:2], 40, 4, 16, now=0)
    assert admission.check_plan(plan, now=0.0) is None
    sched.book("long", plan)
    sched.queues[plan.prefill.node_id].add("long", 500.0)
    for p in cluster.of_role("prefill"):
        sched.queues.setdefault(p.node_id, PrefillQueue()).add("long-" + p.node_id, 500.0)
    late = sched.plan(H[:2], 40, 4, 16, now=0)
    assert admission.check_plan(late, now=1.0, evidence=(False, True)) is None  # no evidence: never refuses
    r = admission.check_plan(late, now=2.0)
    assert isinstance(r, Rejection) and r.retry_after_s == 30  # the backlog is ~500 s: bounded
    assert isinstance(admission.check_plan(late, now=5.5), Rejection)
    assert admission.check_plan(late, now=6.5) is None  # 5 s of refusals since the last admission: a probe
    assert metrics.admission_probes._value.get() == 1
    assert isinstance(admission.check_plan(late, now=7.0), Rejection)
    assert metrics.admission_flips._value.get() == 1  # admit, admit, reject, reject, (probe), reject


def test_tbt_rejection_tracks_the_predicted_decode_load_under_steady_arrivals():
    """A request a second, each predicted to decode for 6.5 s, TBT SLO 41 ms (5 sequences of 40
    tokens (every booked one alike) at the prior's 30 ms + 2 ms each + 2 ms per 1,000 KV tokens: 40.4 ms; 6: 42.5 ms):
    admission follows the batch predicted at first-token time exactly, and the decision flips
    only when that prediction crosses the SLO."""
    sched, _, _ = make()
    metrics = Metrics()
    admission = Admission(AdmissionConfig(tbt_slo_ms=41, probe_after_s=1e9), metrics)
    admission.last_admitted = 0.0
    verdicts = []
    for i in range(60):
        now = float(i)
        plan = sched.plan(H[:2], 40, 1, 16, now=now)
        plan.expected_end = now + plan.est_ttft_s + 6.5
        admitted = admission.check_plan(plan, now) is None
        verdicts.append((plan.decode_batch <= 5, admitted))
        if admitted:
            sched.book(f"r{i}", plan)
    assert all(fits == admitted for fits, admitted in verdicts)
    changes = sum(a != b for (_, a), (_, b) in zip(verdicts, verdicts[1:]))
    assert metrics.admission_flips._value.get() == changes
    assert 10 <= sum(a for _, a in verdicts) <= 50  # held near the SLO: some admitted, some refused


def test_blocks_a_booked_request_will_compute_count_as_cached_behind_it():
    sched, cluster, _ = make()
    cluster.get("p1").draining = True  # one prefill instance: the second request queues behind the first
    cluster.reindex()
    first = sched.plan(H[:8], n_tokens=8 * 16 + 5, max_tokens=4, block_tokens=16, now=0)
    assert first.device_blocks == 0
    sched.book("r1", first)
    # The same prefix right behind it: its prefill instance will hold the blocks by then.
    second = sched.plan(H[:8], n_tokens=8 * 16 + 5, max_tokens=4, block_tokens=16, now=0)
    assert second.prefill is first.prefill and second.device_blocks == 8
    assert second.est_prefill_s < first.est_prefill_s / 2  # 5 tokens to compute instead of 133
    assert second.decode_blocks == first.decode_blocks - 8  # shared on the decode instance too
    sched.release("r1")  # it failed before computing anything: nothing is pending any more
    third = sched.plan(H[:8], n_tokens=8 * 16 + 5, max_tokens=4, block_tokens=16, now=0)
    assert third.device_blocks == 0 and third.decode_blocks == first.decode_blocks


def test_a_full_decode_pool_delays_the_predicted_first_token_until_room_frees():
    sched, cluster, _ = make()
    cluster.get("d0").info = NodeInfo(node_name="n0", pid=1, num_blocks=20)
    plan = sched.plan(H[:2], 40, 24, 16, now=0)  # 40 + 24 tokens: 4 blocks + 1 of headroom
    assert plan.reserve_wait_s == 0 and plan.decode_blocks == 5
    free_ttft = plan.est_ttft_s
    assert "d0" not in sched.slots  # planning books nothing
    for i, end in enumerate((10.0, 20.0, 30.0, 40.0)):  # four others fill the pool until they end
        sched.interactive_slots.setdefault("d0", DecodeSlots()).add(f"r{i}", end, 5)
    plan = sched.plan(H[2:4], 40, 24, 16, now=0)
    assert plan.reserve_wait_s == pytest.approx(10.0)  # room once the first of them ends
    assert plan.est_ttft_s == pytest.approx(10.0 + free_ttft, rel=0.01)
    assert plan.best_ttft_s == pytest.approx(plan.est_ttft_s)
    cluster.upsert(node("d1", "decode", "n1", kv="tcp://d1"))  # an instance with room wins
    cluster.get("d1").info = NodeInfo(node_name="n1", pid=1, num_blocks=20)
    plan = sched.plan(H[2:4], 40, 24, 16, now=0)
    assert plan.decode.node_id == "d1" and plan.reserve_wait_s == 0


def test_a_request_larger_than_the_pool_waits_for_it_to_empty():
    sched, cluster, _ = make()
    cluster.get("d0").info = NodeInfo(node_name="n0", pid=1, num_blocks=4)
    sched.interactive_slots["d0"] = DecodeSlots()
    sched.interactive_slots["d0"].add("small", 7.0, 2)
    plan = sched.plan(H[:4], 100, 20, 16, now=0)  # 9 blocks: more than the whole pool
    assert plan.reserve_wait_s == pytest.approx(7.0)


def test_a_request_that_would_push_queued_ones_past_their_slo_is_refused():
    """Prefill packs the chunks of queued requests into one forward: a newcomer delays them too."""
    sched, cluster, _ = make()
    cluster.get("p1").draining = True
    cluster.reindex()
    admission = Admission(AdmissionConfig(ttft_slo_ms=10_000), Metrics())
    admission.last_admitted = 0.0
    first = sched.plan(H[:2], 40, 4, 16, now=0)
    assert admission.check_plan(first, now=0.0) is None
    sched.book("r1", first, deadline=first.est_ttft_s + 0.001)  # admitted with almost no slack left
    second = sched.plan(H[2:4], 40, 4, 16, now=0)
    assert second.queue_slack_s == pytest.approx(first.est_ttft_s + 0.001)
    r = admission.check_plan(second, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "ttft_slo" and "queued ahead" in r.message
    sched.prefill_finished("r1")  # its first token came: it no longer waits on the pack
    assert admission.check_plan(sched.plan(H[2:4], 40, 4, 16, now=0), now=0.0) is None


def test_predicted_tbt_counts_the_kv_of_the_batch_it_joins():
    """The decode step grows with the KV the batch holds: a short request joining long ones is
    predicted a longer step than one joining short ones (the prior: 2 ms per 1,000 KV tokens)."""
    def tbt_after(booked_tokens: int) -> float:
        sched, _, _ = make()
        for i in range(3):
            sched.book(f"r{i}", sched.plan(H[:1], booked_tokens, 200, 16, now=0.0))
        plan = sched.plan(H[:1], 40, 8, 16, now=0.0)
        assert plan.decode_batch == 4 and plan.decode_kv_tokens == 40 + 4
        return plan.est_tbt_s

    short, long = tbt_after(100), tbt_after(8000)
    assert long - short == pytest.approx(3 * (8000 - 100) * 0.002 / 1000, rel=1e-6)
