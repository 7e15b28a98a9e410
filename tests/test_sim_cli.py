"""``mooncake sim run`` / ``sim size`` end to end through the CLI; determinism; the policy
order on a generated chat trace; the size search against brute force."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import ANY

import pytest

from mooncake.cli import main
from mooncake.sim.profiles import hardware_for
from mooncake.sim.setup import SimSetup
from mooncake.sim.simulator import simulate
from mooncake.sim.size import size_cluster
from mooncake.sim.synthetic import ChatTraceSpec, chat_trace, write_trace
from mooncake.sim.workload import load_requests, requests_from_records

FIELDS = ("requests", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p90_s", "slo_attainment",
          "goodput_rps", "cache_hit_rate", "rejected", "sim_wall_s")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "chat.jsonl"
    write_trace(chat_trace(ChatTraceSpec(conversations=40, rate_per_s=2.0, system_prompts=4, seed=3)), path)
    return path


def _run(trace: Path, out: Path, *extra: str) -> dict:
    rc = main(["sim", "run", "--trace", str(trace), "--block-tokens", "512", "--prefill", "2", "--decode", "2",
               "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_run_writes_every_field(small_trace: Path, tmp_path: Path, capsys) -> None:
    res = _run(small_trace, tmp_path / "r.json", "--policy", "cache_aware", "--profile", "a800x8-llama2-70b",
               "--ttft-slo-ms", "5000", "--tbt-slo-ms", "200")
    assert all(k in res for k in FIELDS)
    n = sum(1 for line in small_trace.read_text().splitlines() if line.strip())
    assert res["requests"] == n and res["completed"] + res["rejected"] == n
    assert 0 < res["ttft_p50_s"] <= res["ttft_p90_s"] <= res["ttft_p99_s"]
    assert 0 < res["tbt_p90_s"] < 0.2 and 0 < res["cache_hit_rate"] < 1 and 0 < res["slo_attainment"] <= 1
    assert res["goodput_rps"] > 0 and res["sim_wall_s"] > 0
    out = capsys.readouterr().out
    assert "ttft_p90_s" in out and "2 prefill + 2 decode" in out


def test_same_seed_same_result(small_trace: Path, tmp_path: Path) -> None:
    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "sim_wall_s"}

    a = _run(small_trace, tmp_path / "a.json", "--policy", "random", "--seed", "7", "--rate-scale", "4")
    b = _run(small_trace, tmp_path / "b.json", "--policy", "random", "--seed", "7", "--rate-scale", "4")
    assert strip(a) == strip(b)
    c = _run(small_trace, tmp_path / "c.json", "--policy", "random", "--seed", "8", "--rate-scale", "4")
    assert strip(c) != strip(a)  # the seed does drive the random policy


def test_no_store_and_reuse_scale_lower_reuse(small_trace: Path, tmp_path: Path) -> None:
    full = _run(small_trace, tmp_path / "f.json", "--policy", "least_loaded", "--store", "on")
    local = _run(small_trace, tmp_path / "l.json", "--policy", "least_loaded", "--no-store")
    assert _run(small_trace, tmp_path / "a.json", "--policy", "least_loaded") == {**local, "sim_wall_s": ANY}
    none = _run(small_trace, tmp_path / "n.json", "--policy", "cache_aware", "--reuse-scale", "0")
    assert local["cache_hit_rate"] < full["cache_hit_rate"]
    assert none["cache_hit_rate"] == 0.0


def test_early_rejection_refuses_what_cannot_meet_the_ttft_slo(small_trace: Path, tmp_path: Path) -> None:
    res = _run(small_trace, tmp_path / "r.json", "--ttft-slo-ms", "50")
    assert res["rejected"] > 0 and res["rejected_by_reason"].get("ttft_slo", 0) > 0


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/nonexistent.jsonl"], "no such file"),
    (["--profile", "tpu-v9"], "unknown profile"),
    (["--reuse-scale", "2"], "reuse_scale"),
    (["--max-requests", "0"], "--max-requests"),
    (["--calibrate", "http://127.0.0.1:9"], "GET http://127.0.0.1:9/cluster"),
])
def test_run_bad_input_is_a_clear_error(small_trace: Path, argv: list[str], message: str, capsys) -> None:
    args = ["sim", "run", "--trace", str(small_trace), "--prefill", "1", "--decode", "1"]
    assert main(args + argv) == 2
    assert message in capsys.readouterr().err


def test_bad_trace_line_is_named(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    assert main(["sim", "run", "--trace", str(bad), "--prefill", "1", "--decode", "1"]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_zero_instances_rejected(small_trace: Path, capsys) -> None:
    assert main(["sim", "run", "--trace", str(small_trace), "--prefill", "0", "--decode", "1"]) == 2
    assert "at least one prefill" in capsys.readouterr().err


def test_policy_order_on_a_generated_chat_trace() -> None:
    """16 + 16 instances, a800 profile, a load that queues prefill: random > least_loaded >
    cache_aware without the store pool > cache_aware (the baselines reuse only their own device
    cache, as in the paper; only global cache-aware reads the pool)."""
    reqs = requests_from_records(chat_trace(ChatTraceSpec(conversations=300, rate_per_s=5, system_prompts=64,
                                                          question_tokens=1500, seed=11)))
    hw = hardware_for("a800x8-llama2-70b", 512)
    runs = [simulate(SimSetup(16, 16, policy, store), hw, reqs) for policy, store in
            (("random", False), ("least_loaded", False), ("cache_aware", False), ("cache_aware", True))]
    ttft = [r.ttft_mean_s for r in runs]
    assert ttft[0] > ttft[1] > ttft[2] > ttft[3], ttft
    assert runs[0].queue_mean_s > 0.1  # the load does queue prefill
    assert runs[3].cache_hit_rate > runs[2].cache_hit_rate > runs[1].cache_hit_rate


def test_size_finds_the_smallest_qualifying_cluster(small_trace: Path) -> None:
    reqs = load_requests(small_trace, rate_scale=30.0)
    hw = hardware_for("a800x8-llama2-70b", 512)
    template = SimSetup(1, 1, "cache_aware", True, ttft_slo_ms=2000, tbt_slo_ms=30)
    answer = size_cluster(reqs, hw, template, 0.7, max_prefill=4, max_decode=4)
    brute = {(p, d): simulate(SimSetup(p, d, "cache_aware", True, 2000, 30), hw, reqs).slo_attainment
             for p in range(1, 5) for d in range(1, 5)}
    qualifying = sorted((p + d, p, d) for (p, d), a in brute.items() if a >= 0.7)
    assert qualifying, "the tiny case must have a qualifying size"
    assert answer.best == qualifying[0][1:]
    assert sum(answer.best) > 3  # the case does need more than the minimum
    assert len(answer.evaluated) < len(brute)  # and the search did not simulate every size
    for (p, d), r in answer.evaluated.items():
        assert r.slo_attainment == brute[(p, d)]  # the search's simulations are the same simulations


def test_size_cli_table_plot_and_no_answer(small_trace: Path, tmp_path: Path, capsys) -> None:
    png, out = tmp_path / "frontier.png", tmp_path / "size.json"
    rc = main(["sim", "size", "--trace", str(small_trace), "--block-tokens", "512", "--profile", "a800x8-llama2-70b",
               "--ttft-slo-ms", "2000", "--tbt-slo-ms", "30", "--attainment", "0.7", "--rate-scale", "30",
               "--max-prefill", "4", "--max-decode", "4", "--plot", str(png), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "smallest cluster:" in text and "prefill" in text.splitlines()[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert data["best"]["prefill"] >= 1 and data["frontier"] and data["evaluated"]
    rc = main(["sim", "size", "--trace", str(small_trace), "--ttft-slo-ms", "1", "--tbt-slo-ms", "1",
               "--max-prefill", "2", "--max-decode", "2"])
    assert rc == 0
    assert "no cluster up to 2 prefill + 2 decode" in capsys.readouterr().out
    assert main(["sim", "size", "--trace", str(small_trace)]) == 2
    assert "needs an SLO" in capsys.readouterr().err
