"""The scheduler and pipeline groups (issue 12): which instances group, the pipeline's TTFT
estimate, a group chosen only when it beats the best single instance and never for short
prompts, its work booked on every stage, groups re-formed when a stage is gone."""

from __future__ import annotations

import pytest

from mooncake.config import ConductorConfig
from mooncake.protocol import NodeInfo
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.pipeline import PipelineShape, group_chunk_tokens, pipeline_groups, pipeline_prefill_s
from mooncake.sched.scheduler import Scheduler

H = [bytes([i % 256, i // 256]) * 16 for i in range(400)]
T = 16


def node(node_id: str, role: str, **endpoints: str) -> Node:
    return Node(node_id, role, node_id.encode(), endpoints, NodeInfo("m", 1), 0.0)


def make(prefills: int = 3) -> tuple[Scheduler, Cluster, KVIndex]:
    cluster, idx = Cluster(), KVIndex()
    for i in range(prefills):
        cluster.upsert(node(f"p{i}", "prefill", act=f"tcp://p{i}"))
    cluster.upsert(node("s0", "store", store="tcp://s0"))
    cluster.upsert(node("d0", "decode", kv="tcp://d0"))
    return Scheduler(ConductorConfig(), cluster, idx, PrefillCostModel(), DecodeCostModel()), cluster, idx


def shape(size: int = 2, min_tokens: int = 2048) -> PipelineShape:
    return PipelineShape(size, min_tokens, num_layers=30, chunk_tokens=512, activation_bytes_per_token=576 * 4)


def test_groups_are_live_instances_with_an_activation_ingress_in_node_order():
    nodes = [node("p2", "prefill", act="x"), node("p0", "prefill", act="x"), node("p1", "prefill"),
             node("p3", "prefill", act="x")]
    assert [[n.node_id for n in g] for g in pipeline_groups(nodes, 2)] == [["p0", "p2"]]  # p3 alone, p1 cannot
    assert pipeline_groups(nodes, 1) == [] and pipeline_groups(nodes, 4) == []


def test_pipeline_estimate_is_fill_plus_chunks_of_the_slowest_stage():
    # 24 chunks of a 12 s prefill, 2 even stages: a one-step fill + 24 steps of 0.25 s + 0.01 s hand-over
    assert pipeline_prefill_s(12.0, 6000, 256, [(0, 15), (15, 30)], 0.01) == pytest.approx(25 * 0.26)
    # uneven stages: the slowest (20 of 30 layers) sets the pace
    assert pipeline_prefill_s(12.0, 6000, 512, [(0, 10), (10, 30)], 0.0) == pytest.approx(13 * 1.0 * 20 / 30)
    assert group_chunk_tokens(512, 2, 16) == 256 and group_chunk_tokens(512, 3, 16) == 170
    assert group_chunk_tokens(20, 3, 16) == 16 and group_chunk_tokens(512, 1) == 512


def test_a_long_prompt_goes_to_a_group_and_is_booked_on_every_stage():
    sched, _, _ = make()
    plan = sched.plan(H[:375], 6000, 4, T, now=0, pipeline=shape())
    assert [n.node_id for n in plan.stages] == ["p0", "p1"] and plan.prefill.node_id == "p1"
    single = sched.plan(H[:375], 6000, 4, T, now=0)
    assert plan.est_prefill_s < 0.6 * single.est_prefill_s
    sched.book("r", plan)
    assert sched.queued("p0") == sched.queued("p1") == 1 and sched.queued("p2") == 0
    sched.prefill_finished("r")
    assert sched.queued("p0") == sched.queued("p1") == 0
    sched.release("r")


def test_short_prompts_never_use_a_group():
    sched, _, _ = make()
    plan = sched.plan(H[:100], 1600, 4, T, now=0, pipeline=shape(min_tokens=2048))
    assert plan.stages == []
    assert sched.plan(H[:375], 6000, 4, T, now=0, pipeline=None).stages == []  # groups off


def test_cached_tokens_do_not_count_towards_the_minimum():
    sched, _, idx = make()
    idx.add("s0", "dram", H[:300])  # 4,800 of 6,000 tokens in the store: 1,200 to compute
    plan = sched.plan(H[:375], 6000, 4, T, now=0, pipeline=shape(min_tokens=2048))
    assert plan.stages == [] and plan.reusable_blocks == 300


def test_a_group_that_would_be_slower_than_an_idle_instance_is_not_chosen():
    sched, _, _ = make()
    for p in ("p0", "p1"):
        sched._queue(p).add("busy", 60.0)
    plan = sched.plan(H[:375], 6000, 4, T, now=0, pipeline=shape())
    assert plan.stages == [] and plan.prefill.node_id == "p2"


def test_groups_reform_when_a_stage_is_gone():
    sched, cluster, _ = make()
    cluster.remove("p0")
    plan = sched.plan(H[:375], 6000, 4, T, now=0, pipeline=shape())
    assert [n.node_id for n in plan.stages] == ["p1", "p2"]
    cluster.remove("p1")
    assert sched.plan(H[:375], 6000, 4, T, now=0, pipeline=shape()).stages == []
