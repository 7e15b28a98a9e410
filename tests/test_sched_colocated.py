"""The scheduler with colocated instances (``sched/colocated_budget.py``): one decodes what it
prefills, it competes with prefill/decode pairs by predicted end, and its own decoding batch
slows its prompts while its queued prompts slow its decode steps."""

from __future__ import annotations

from mooncake.config import ConductorConfig
from mooncake.protocol import NodeInfo
from mooncake.sched.booking import PrefillQueue
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.scheduler import Scheduler

H = [bytes([i]) * 32 for i in range(10)]


def _cluster(pair: bool, colocated: int = 1, policy: str = "cache_aware") -> tuple[Scheduler, KVIndex]:
    cluster, idx = Cluster(), KVIndex()
    if pair:
        cluster.upsert(Node("p0", "prefill", b"p0", {}, NodeInfo("n0", 1, num_blocks=1000), 0.0))
        cluster.upsert(Node("d0", "decode", b"d0", {"kv": "tcp://d0"}, NodeInfo("n0", 1, num_blocks=1000), 0.0))
    for i in range(colocated):
        cluster.upsert(Node(f"c{i}", "colocated", b"c", {}, NodeInfo(f"m{i}", 1, num_blocks=1000, step_tokens=64), 0.0))
    return Scheduler(ConductorConfig(policy=policy), cluster, idx, PrefillCostModel(), DecodeCostModel()), idx


def test_a_colocated_plan_decodes_where_it_prefills():
    sched, _ = _cluster(pair=False)
    plan = sched.plan(H[:4], n_tokens=70, max_tokens=8, block_tokens=16, now=0)
    assert plan is not None and plan.prefill is plan.decode and plan.prefill.role == "colocated"
    booking = sched.book("r1", plan)
    assert sched.queued("c0") == 1 and sched.assigned("c0") == 1
    sched.prefill_finished("r1")
    assert sched.pending.of("c0")  # its blocks stay pending where it decodes
    booking.release()
    assert sched.assigned("c0") == 0


def test_the_prefix_holder_wins_between_a_pair_and_a_colocated_instance():
    sched, idx = _cluster(pair=True)
    idx.add("c0", "device", H[:8])
    assert sched.plan(H[:8], 8 * 16 + 5, 8, 16, now=0).prefill.node_id == "c0"
    sched, idx = _cluster(pair=True)
    idx.add("p0", "device", H[:8])
    plan = sched.plan(H[:8], 8 * 16 + 5, 8, 16, now=0)
    assert plan.prefill.node_id == "p0" and plan.decode.node_id == "d0"


def test_its_batch_slows_its_prompts_and_its_queue_slows_its_steps():
    sched, _ = _cluster(pair=False)
    alone = sched.plan(H[:8], 8 * 16 + 5, 64, 16, now=0)
    for i in range(6):  # six decoding there: a prompt gets 64 - 6 tokens a step, each step a decode step longer
        p = sched.plan(H[:1], 20, 64, 16, now=0)
        sched.book(f"d{i}", p)
        sched.prefill_finished(f"d{i}")
    busy = sched.plan(H[:8], 8 * 16 + 5, 64, 16, now=0)
    assert busy.est_prefill_s > alone.est_prefill_s
    before = busy.est_tbt_s
    sched.queues.setdefault("c0", PrefillQueue()).add("queued", 3.0)
    assert sched.plan(H[:8], 8 * 16 + 5, 64, 16, now=0).est_tbt_s > before


def test_round_robin_alternates_over_pairs_and_colocated_instances():
    sched, _ = _cluster(pair=True, policy="round_robin")
    chosen = [sched.plan(H[:2], 40, 4, 16, now=0) for _ in range(4)]
    assert [p.prefill.node_id for p in chosen] == ["p0", "c0", "p0", "c0"]
    assert all((p.decode is p.prefill) == (p.prefill.role == "colocated") for p in chosen)


def test_without_a_fixed_budget_the_prediction_follows_the_instances_target():
    """An instance that reports a TBT target (no ``[engine] step_tokens``): a tighter target means
    smaller chunks beside the same batch, so a longer predicted prefill."""
    def busy_prefill_s(target_ms: float) -> float:
        cluster = Cluster()
        cluster.upsert(Node("c0", "colocated", b"c", {}, NodeInfo("m0", 1, num_blocks=1000, step_target_ms=target_ms),
                            0.0))
        sched = Scheduler(ConductorConfig(), cluster, KVIndex(), PrefillCostModel(), DecodeCostModel())
        for i in range(6):
            sched.book(f"d{i}", sched.plan(H[:1], 20, 64, 16, now=0))
            sched.prefill_finished(f"d{i}")
        return sched.plan(H[:8], 8 * 16 + 400, 64, 16, now=0).est_prefill_s

    assert busy_prefill_s(80) > busy_prefill_s(200) > busy_prefill_s(2000)
