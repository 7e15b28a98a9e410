"""The one TTFT estimate (``sched/ttft_estimate.py``): its terms, per-tier fetch costs, and that the
scheduler, its pipeline groups and the simulator all go through it."""

from __future__ import annotations

import pytest

from mooncake.config import ConductorConfig
from mooncake.protocol import NodeInfo
from mooncake.sched.booking import PrefillQueue
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.pipeline import PipelineShape, best_group
from mooncake.sched.scheduler import Scheduler
from mooncake.sched.ttft_estimate import LMDB_FETCH_RATIO, FetchCosts, TTFTEstimate
from mooncake.sim.profiles import hardware_for
from mooncake.sim.setup import SimSetup
from mooncake.sim.simulator import Simulation

H = [bytes([i % 256, i // 256]) * 16 for i in range(400)]
T = 16  # tokens per block
FETCH_S = 0.01  # the measured (default) seconds per block


def node(node_id: str, role: str, **endpoints: str) -> Node:
    return Node(node_id, role, node_id.encode(), endpoints, NodeInfo("m", 1), 0.0)


def make(prefills: int = 2) -> tuple[Scheduler, KVIndex]:
    cluster, idx = Cluster(), KVIndex()
    for i in range(prefills):
        cluster.upsert(node(f"p{i}", "prefill", act=f"tcp://p{i}"))
    for s in ("s0", "s1"):
        cluster.upsert(node(s, "store", store=f"tcp://{s}"))
    cluster.upsert(node("d0", "decode", kv="tcp://d0"))
    return Scheduler(ConductorConfig(), cluster, idx, PrefillCostModel(fetch_block_s=FETCH_S), DecodeCostModel()), idx


def test_the_terms_add_up() -> None:
    est = TTFTEstimate(0.01, FETCH_S)
    assert est.ttft_s(0.2, 2, 10, 0.5) == pytest.approx(0.01 + 0.2 + 8 * FETCH_S + 0.5)
    assert est.ttft_s(0.2, 10, 10, 0.5) == pytest.approx(0.01 + 0.2 + 0.5)  # nothing to fetch
    assert est.ttft_s(0.0, 12, 10, 0.0) == pytest.approx(0.01)  # the instance holds more than the stores


def test_each_block_costs_its_tiers_fetch() -> None:
    lmdb = FETCH_S * LMDB_FETCH_RATIO
    est = TTFTEstimate(0.0, FETCH_S, FetchCosts(), ["dram"] * 4 + ["lmdb"] * 4)
    assert est.ttft_s(0.0, 0, 8, 0.0) == pytest.approx(4 * FETCH_S + 4 * lmdb)
    assert est.ttft_s(0.0, 4, 8, 0.0) == pytest.approx(4 * lmdb)
    assert est.ttft_s(0.0, 6, 10, 0.0) == pytest.approx(2 * lmdb + 2 * FETCH_S)  # past the known tiers: default
    assert est.ttft_s(0.0, 9, 10, 0.0) == pytest.approx(FETCH_S)
    # a tier not named costs the default; uniform ratios make the tiers irrelevant
    assert TTFTEstimate(0.0, FETCH_S, FetchCosts(), ["nvme"] * 3).ttft_s(0.0, 0, 3, 0.0) == pytest.approx(3 * FETCH_S)
    assert TTFTEstimate(0.0, FETCH_S, FetchCosts({"lmdb": 1.0}), ["lmdb"] * 3).ttft_s(0.0, 0, 3, 0.0) == \
        pytest.approx(3 * FETCH_S)
    assert FetchCosts({"lmdb": 2.0, "dram": 1.0}).per_block_s(0.5) == {"lmdb": 1.0, "dram": 0.5}


def test_the_index_tells_the_tier_of_each_block_to_fetch() -> None:
    idx = KVIndex()
    idx.add("s0", "dram", H[:4])
    idx.add("s1", "lmdb", H[4:8])  # the chain goes on in another store's LMDB tier
    idx.add("p0", "device", H[:2])
    runs, store_end = idx.prefix_runs(H[:10], {"s0", "s1"})
    assert list(idx.run_tiers(H[:store_end], {"s0", "s1"}, runs)) == ["dram"] * 4 + ["lmdb"] * 4
    est = TTFTEstimate.of_prompt(PrefillCostModel(fetch_block_s=FETCH_S), FetchCosts(), idx, H[:10],
                                 {"s0", "s1"}, runs, store_end)
    assert est.ttft_s(0.0, 2, 8, 0.0) == pytest.approx(2 * FETCH_S + 4 * FETCH_S * LMDB_FETCH_RATIO)


@pytest.mark.parametrize("tier, picked", [("dram", "p1"), ("lmdb", "p0")])
def test_a_prefix_on_a_slower_tier_is_worth_more_on_the_device(tier: str, picked: str) -> None:
    """p0 holds half the prefix on its device but has work queued; p1 is idle and must fetch it
    all: worth it from DRAM, not from LMDB."""
    sched, idx = make()
    idx.add("s0", tier, H[:8])
    idx.add("p0", "device", H[:4])
    sched.queues["p0"] = PrefillQueue()
    sched.queues["p0"].add("ahead", 0.05)  # between 4 DRAM blocks' fetch (0.04) and 4 LMDB blocks' (0.068)
    plan = sched.plan(H[:8], 8 * T + 1, 4, T, 0.0)
    assert plan is not None and plan.prefill.node_id == picked
    per_block = FETCH_S * (LMDB_FETCH_RATIO if tier == "lmdb" else 1.0)
    fetched = 8 - plan.device_blocks
    assert plan.est_ttft_s == pytest.approx(sched.prefill_cost.dispatch.value + plan.queue_s + fetched * per_block
                                            + plan.est_prefill_s)


def test_scheduler_and_pipeline_groups_use_the_same_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, int, int, float]] = []
    real = TTFTEstimate.ttft_s

    def spy(self: TTFTEstimate, queue_s: float, dev: int, reusable: int, prefill_s: float) -> float:
        calls.append((queue_s, dev, reusable, prefill_s))
        return real(self, queue_s, dev, reusable, prefill_s)

    monkeypatch.setattr(TTFTEstimate, "ttft_s", spy)
    sched, idx = make(prefills=2)
    idx.add("s0", "lmdb", H[:100])
    shape = PipelineShape(2, 2048, num_layers=30, chunk_tokens=512, activation_bytes_per_token=576 * 4)
    plan = sched.plan(H[:375], 6000, 4, T, 0.0, pipeline=shape)
    assert plan is not None and len(calls) == 3  # each instance, then the one group
    # the same numbers for the same inputs, from the scheduler's estimate and from best_group
    stores = {"s0", "s1"}
    est = TTFTEstimate.of_prompt(sched.prefill_cost, sched.fetch_costs, idx, H[:374], stores,
                                 *idx.prefix_runs(H[:374], stores))
    group = best_group(shape, sched.cluster.of_role("prefill"), sched.prefill_cost, est, lambda n: 0,
                       lambda n: 0.0, 100, 6000, T)
    assert group is not None and calls[-1] == (0.0, 0, 100, group[1])  # the group the scheduler weighed
    assert group[0] == pytest.approx(real(est, *calls[-1]))
    assert group[0] - group[1] == pytest.approx(est.dispatch_s + 100 * FETCH_S * LMDB_FETCH_RATIO)  # LMDB-priced
    single = min(calls[:2])
    assert real(est, *single) == pytest.approx(real(est, 0.0, 0, 100, single[3]))
    assert plan.est_ttft_s == pytest.approx(min(real(est, *c) for c in calls))


def test_the_simulator_plans_with_its_hardwares_tier_costs() -> None:
    hw = hardware_for("l4-llama3-8b", 512)
    sim = Simulation(SimSetup(prefill=1, decode=1), hw, [])
    ratio = hw.fetch_block_s("lmdb", True) / hw.fetch_block_s("dram", True)
    assert ratio > 1 and sim.sched.fetch_costs.ratios == {"dram": 1.0, "lmdb": pytest.approx(ratio)}
    assert sim.prefill_cost.fetch_block_s == hw.fetch_block_s("dram", True)  # the figure the ratios scale
