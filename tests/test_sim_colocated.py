"""Colocated instances in the simulator: the mixed step's cost, the step loop against hand-worked
timings, every request served, prompt chunks stretching a colocated instance's TBT (not a
pair's), mixed clusters, sizing both designs, the CLI and calibration from a colocated cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake.cli import main
from mooncake.sim.calibrate import calibrated_hardware
from mooncake.sched.colocated_budget import DEFAULT_TBT_TARGET_MS
from mooncake.sim.colocated_steps import budget_ladder, step_budget
from mooncake.sim.hardware import Capacities, FittedHardware, LinearCosts
from mooncake.sim.profiles import hardware_for
from mooncake.sim.setup import SimSetup
from mooncake.sim.shared_cpu import Colocation
from mooncake.sim.simulator import Simulation, simulate
from mooncake.sim.size import size_cluster
from mooncake.sim.synthetic import ChatTraceSpec, chat_trace, write_trace
from mooncake.sim.workload import SimRequest, load_requests, requests_from_records

UNBOUNDED = 1 << 40
CAPS = Capacities(prefill_cache_blocks=UNBOUNDED, decode_kv_tokens=UNBOUNDED, decode_max_batch=32,
                  colocated_kv_tokens=UNBOUNDED, store_dram_blocks=UNBOUNDED, store_lmdb_blocks=UNBOUNDED)
# 1 ms per prompt token, 10 ms per decode step, nothing else; chunks of 512 tokens.
COSTS = LinearCosts(prefill_fixed_s=0.0, prefill_per_token_s=0.001, prefill_per_pair_s=0.0, decode_step_s=0.01,
                    decode_per_seq_s=0.0, fetch_block_s=0.0, transfer_token_s=0.0)


def linear(colocation: Colocation | None = None) -> FittedHardware:
    return FittedHardware("linear", 16, COSTS, CAPS, colocation=colocation)


def request(i: int, arrival: float, prompt: int, output: int) -> SimRequest:
    hashes = tuple((1000 * i + b).to_bytes(8, "little") for b in range(prompt // 16))
    return SimRequest(f"r{i}", arrival, prompt, output, hashes)


def run(setup: SimSetup, hw, requests: list[SimRequest]) -> Simulation:
    sim = Simulation(setup, hw, requests)
    sim.run()
    return sim


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sim-colocated") / "chat.jsonl"
    write_trace(chat_trace(ChatTraceSpec(conversations=40, rate_per_s=2.0, system_prompts=4, seed=3)), path)
    return path


def test_mixed_step_costs_one_forward_of_both_halves() -> None:
    hw = hardware_for("a800x8-llama2-70b", 512)
    assert hw.mixed_step_s(16, 16 * 4096, []) == hw.decode_step_s(16, 16 * 4096)
    assert hw.mixed_step_s(0, 0, [(2048, 1024)]) == pytest.approx(hw.prefill_s(2048, 1024))
    both = hw.mixed_step_s(16, 16 * 4096, [(512, 1024)])
    apart = hw.decode_step_s(16, 16 * 4096) + hw.prefill_s(512, 1024)
    assert max(hw.decode_step_s(16, 16 * 4096), hw.prefill_s(512, 1024)) <= both < apart  # one roofline, not two
    lin = linear()  # a live cluster's costs: a decode forward, then the chunk's (as the live role runs them)
    assert lin.mixed_step_s(4, 0, [(100, 0)]) == pytest.approx(0.01 + 0.1)
    assert lin.mixed_step_s(0, 0, [(100, 0)]) == pytest.approx(lin.prefill_s(100, 0))


def test_step_budget_follows_the_tbt_slo_as_the_live_role_does() -> None:
    hw = hardware_for("a800x8-llama2-70b", 512)
    assert step_budget(hw, 0) == step_budget(hw, DEFAULT_TBT_TARGET_MS)  # no SLO: the role's default target
    budgets = [step_budget(hw, slo) for slo in (30, 50, 100, 10_000)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[2] and budgets[-1] == hw.chunk_tokens
    assert all(b % 16 == 0 for b in budgets)
    assert step_budget(hw, 1) == 16  # nothing fits: one block
    assert budget_ladder(hw, 100) == [step_budget(hw, 100), 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    assert FittedHardware("cal", 16, COSTS, CAPS, step_tokens=192).step_tokens == 192
    assert step_budget(FittedHardware("cal", 16, COSTS, CAPS, step_tokens=192), 30) == 192  # as the cluster runs


def test_steps_follow_hand_worked_timings() -> None:
    # r0: 100 prompt tokens alone (one step of 0.1 s), then 10 decode steps of 10 ms each.
    sim = run(SimSetup(colocated=1, step_tokens=64, use_store=False), linear(), [request(0, 0.0, 100, 11)])
    o = sim.outcomes["r0"]
    assert o.ttft_s == pytest.approx(0.1) and o.finished_s == pytest.approx(0.2) and o.tbt_s == pytest.approx(0.01)
    # r1 (200 tokens) arrives while r0 decodes: it joins at the next step boundary and takes
    # 63 tokens a step (64 less r0's row): 4 steps of 10 ms + 1 ms per chunk token.
    sim = run(SimSetup(colocated=1, step_tokens=64, use_store=False), linear(),
              [request(0, 0.0, 100, 101), request(1, 0.105, 200, 2)])
    r1 = sim.outcomes["r1"]
    steps = [0.01 + n * 0.001 for n in (63, 63, 63, 11)]
    assert r1.started_s == pytest.approx(0.105) and r1.first_token_s == pytest.approx(0.11 + sum(steps))
    r0 = sim.outcomes["r0"]
    assert r0.finished_s == pytest.approx(0.1 + 100 * 0.01 + sum(s - 0.01 for s in steps))
    # a budget the batch fills still moves a prompt by an engine block (16 tokens) a step
    sim = run(SimSetup(colocated=1, step_tokens=16, use_store=False), linear(),
              [request(0, 0.0, 100, 101), request(1, 0.105, 200, 2)])
    assert sim.outcomes["r1"].first_token_s == pytest.approx(0.11 + 12 * (0.01 + 0.016) + (0.01 + 0.008))


def test_at_most_max_prefill_batch_prompts_hold_room() -> None:
    reqs = [request(i, 0.0, 100, 2) for i in range(10)]
    sim = run(SimSetup(colocated=1, use_store=False), linear(), reqs)
    first = min(o.first_token_s for o in sim.outcomes.values())
    started = sorted(o.started_s for o in sim.outcomes.values())
    assert started[:8] == [0.0] * 8 and min(started[8:]) >= first


def test_a_colocated_cluster_serves_every_request_and_books_nothing_after(chat: Path) -> None:
    reqs = load_requests(chat, rate_scale=4.0)
    sim = run(SimSetup(colocated=2), hardware_for("a800x8-llama2-70b", 512), reqs)
    out = list(sim.outcomes.values())
    assert len(out) == len(reqs) and all(o.rejected is None for o in out)
    assert all(o.req.arrival_s <= o.started_s <= o.first_token_s <= o.finished_s for o in out)
    assert sum(o.reused_blocks for o in out) > 0  # prefixes reused: its own cache and the stores
    assert sim.sched.waiting() == 0 and all(sim.sched.in_flight(k) == 0 for k in range(3))
    assert not sim.sched.queues or all(not q.work for q in sim.sched.queues.values())
    for ci in sim.colocated.values():
        assert not ci.batch.active and not ci.prompts and not ci.queue and ci.batch.kv_reserved == 0


def _decoder_and_prompts(n_prompts: int) -> list[SimRequest]:
    """r0 decodes 400 tokens; prompts of 2,000 tokens arrive every 0.5 s meanwhile."""
    return [request(0, 0.0, 64, 401)] + [request(i, 0.5 * i, 2000, 2) for i in range(1, n_prompts + 1)]


def test_prompt_load_stretches_a_colocated_instances_tbt_not_a_pairs() -> None:
    hw = linear()
    tbt = {}
    for n in (0, 4):
        reqs = _decoder_and_prompts(n)
        colocated = run(SimSetup(colocated=1, step_tokens=128, use_store=False), hw, reqs).outcomes["r0"].tbt_s
        pair = run(SimSetup(1, 1, use_store=False), hw, reqs).outcomes["r0"].tbt_s
        tbt[n] = (colocated, pair)
    assert tbt[0][0] == pytest.approx(0.01) and tbt[0][1] == pytest.approx(0.01)
    assert tbt[4][1] == pytest.approx(0.01)  # the pair's decode steps carry no prompt
    assert tbt[4][0] > 1.5 * tbt[0][0]  # the colocated steps carry every chunk of 4 prompts


def test_instances_sharing_cores_share_colocated_steps() -> None:
    reqs = [request(0, 0.0, 1000, 1), request(1, 0.0, 1000, 1)]
    alone = run(SimSetup(colocated=2, use_store=False, policy="least_loaded"), linear(), reqs)
    shared = run(SimSetup(colocated=2, use_store=False, policy="least_loaded"), linear(Colocation(cores=1)), reqs)
    assert [o.ttft_s for o in alone.outcomes.values()] == pytest.approx([1.0, 1.0])
    assert [o.ttft_s for o in shared.outcomes.values()] == pytest.approx([2.0, 2.0])


def test_a_mixed_cluster_sends_work_to_both_kinds(chat: Path) -> None:
    reqs = load_requests(chat, rate_scale=8.0)
    sim = run(SimSetup(1, 1, colocated=1, ttft_slo_ms=20_000), hardware_for("a800x8-llama2-70b", 512), reqs)
    served = [o for o in sim.outcomes.values() if o.rejected is None]
    colocated = sum(1 for o in served if o.decode_joined_s >= 0 and o.decode_joined_s == o.first_token_s)
    assert 0 < colocated < len(served)  # a colocated sequence decodes from its first token on, in place


def test_size_answers_for_both_designs(chat: Path) -> None:
    reqs = load_requests(chat, rate_scale=30.0)
    hw = hardware_for("a800x8-llama2-70b", 512)
    template = SimSetup(1, 1, ttft_slo_ms=2000, tbt_slo_ms=60, step_tokens=256)
    fixed = size_cluster(reqs, hw, template, 0.7, max_prefill=4, max_decode=4, max_colocated=8)
    brute = {n: simulate(SimSetup(colocated=n, ttft_slo_ms=2000, tbt_slo_ms=60, step_tokens=256), hw,
                         reqs).slo_attainment for n in range(1, 9)}
    assert fixed.colocated == min(n for n, a in brute.items() if a >= 0.7)
    assert fixed.colocated_step_tokens == 256 and {b for _, b in fixed.colocated_evaluated} == {256}
    # without --step-tokens, the budgets of the ladder (256 among them) compete: never more instances
    answer = size_cluster(reqs, hw, SimSetup(1, 1, ttft_slo_ms=2000, tbt_slo_ms=60), 0.7, 4, 4, max_colocated=8)
    assert answer.colocated is not None and answer.colocated <= fixed.colocated
    assert {b for _, b in answer.colocated_evaluated} == set(budget_ladder(hw, 60))
    assert answer.best is not None
    d = answer.to_dict()
    assert d["best"] and d["frontier"] and d["evaluated"]  # the disaggregated keys, as before
    assert d["colocated"]["best"] == answer.colocated and d["colocated"]["step_tokens"] in budget_ladder(hw, 60)
    designs = d["designs"]
    assert designs["disaggregated"] == sum(answer.best) and designs["colocated"] == answer.colocated
    fewer = "colocated" if answer.colocated < sum(answer.best) else "disaggregated"
    assert designs["fewer"] == (fewer if answer.colocated != sum(answer.best) else "tie")
    assert designs["saved_instances"] == abs(answer.colocated - sum(answer.best))


def test_cli_runs_colocated_alone_and_beside_pairs(chat: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    base = ["sim", "run", "--trace", str(chat), "--json", str(out)]
    assert main(base + ["--colocated", "2", "--tbt-slo-ms", "100"]) == 0
    res = json.loads(out.read_text())
    assert (res["prefill"], res["decode"], res["colocated"]) == (0, 0, 2) and res["completed"] == res["requests"]
    assert res["step_tokens"] == step_budget(hardware_for("a800x8-llama2-70b", 512), 100)
    assert "2 colocated (" in capsys.readouterr().out
    assert main(base + ["--colocated", "1", "--prefill", "1", "--decode", "1", "--step-tokens", "256"]) == 0
    res = json.loads(out.read_text())
    assert (res["prefill"], res["decode"], res["colocated"], res["step_tokens"]) == (1, 1, 1, 256)
    assert "1 prefill + 1 decode + 1 colocated (256 tokens per step)" in capsys.readouterr().out
    needs = "a cluster needs at least one prefill and one decode instance, or a colocated one"
    for bad, message in (([], needs), (["--prefill", "1"], needs), (["--colocated", "1", "--decode", "1"], needs),
                         (["--colocated", "-1"], "must be >= 0"), (["--colocated", "1", "--step-tokens", "-8"], ">= 0")):
        assert main(base + bad) == 2
        assert message in capsys.readouterr().err


def test_cli_size_reports_both_designs_and_plots_them(chat: Path, tmp_path: Path, capsys) -> None:
    png, out = tmp_path / "size.png", tmp_path / "size.json"
    assert main(["sim", "size", "--trace", str(chat), "--ttft-slo-ms", "2000", "--tbt-slo-ms", "60",
                 "--attainment", "0.7", "--rate-scale", "30", "--max-prefill", "4", "--max-decode", "4",
                 "--max-colocated", "8", "--plot", str(png), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smallest cluster:" in text and "smallest colocated cluster:" in text and "designs: " in text
    data = json.loads(out.read_text())
    assert set(data["designs"]) == {"disaggregated", "colocated", "fewer", "saved_instances", "ratio"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["sim", "size", "--trace", str(chat), "--tbt-slo-ms", "60", "--max-prefill", "2",
                 "--max-decode", "2", "--max-colocated", "0", "--json", str(out)]) == 0
    assert "colocated" not in json.loads(out.read_text())  # sized disaggregated only, as before


def test_output_scale_scales_output_lengths(chat: Path) -> None:
    from mooncake.bench.trace import load_trace

    records = load_trace(chat)
    base = requests_from_records(records)
    longer = requests_from_records(records, output_scale=4.0)
    assert [r.output_tokens for r in longer] == [max(1, round(r.output_tokens * 4.0)) for r in base]
    assert [r.hashes for r in longer] == [r.hashes for r in base]
    with pytest.raises(ValueError, match="output_scale"):
        requests_from_records(records, output_scale=0)


def test_a_cluster_of_colocated_instances_calibrates() -> None:
    cluster = {"block_tokens": 16,
               "estimates": {"prefill_1k_tokens_s": 0.5, "decode_step_batch_8_s": 0.046, "decode_step_s": 0.02,
                             "decode_per_seq_s": 0.003},
               "nodes": [{"role": "colocated", "name": "box", "machine": "boot-1", "cpus": 2, "threads": 1,
                          "num_blocks": 2048, "step_tokens": 192},
                         {"role": "colocated", "name": "box2", "machine": "boot-1", "cpus": 2, "threads": 1,
                          "num_blocks": 4096, "step_tokens": 256},
                         {"role": "store", "name": "box", "load": {}}]}
    hw = calibrated_hardware(cluster, block_tokens=64)
    assert hw.prefill_s(1000, 0) == pytest.approx(0.5) and hw.decode_step_s(10, 0) == pytest.approx(0.05)
    assert hw.caps.prefill_cache_blocks == 512  # 2,048 engine blocks of 16 tokens, in blocks of 64
    assert hw.step_tokens == 192 and hw.colocation == Colocation(cores=2, threads=1)
    trace = requests_from_records(chat_trace(ChatTraceSpec(conversations=10, system_prompts=2, seed=1)),
                                  block_tokens=64)
    r = simulate(SimSetup(colocated=2), hw, trace)
    assert r.completed == r.requests and r.step_tokens == 192
