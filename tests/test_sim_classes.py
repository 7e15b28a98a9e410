"""Request classes in the simulator: a share of a trace's requests as flex work, served behind
the interactive ones in every queue, against the same requests with classes off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake.bench.trace import TraceError, load_trace
from mooncake.cli import main
from mooncake.sim.synthetic import ChatTraceSpec, chat_trace, write_trace
from mooncake.sim.workload import requests_from_records


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sim-classes") / "chat.jsonl"
    write_trace(chat_trace(ChatTraceSpec(conversations=60, rate_per_s=4.0, system_prompts=4, seed=5)), path)
    return path


def _run(trace: Path, out: Path, *extra: str) -> dict:
    rc = main(["sim", "run", "--trace", str(trace), "--prefill", "1", "--decode", "1", "--rate-scale", "4",
               "--ttft-slo-ms", "3000", "--tbt-slo-ms", "100", "--flex-share", "0.3", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_the_flex_share_is_drawn_by_seed():
    records = chat_trace(ChatTraceSpec(conversations=60, rate_per_s=4.0, seed=5))
    a = requests_from_records(records, flex_share=0.3, seed=1)
    assert [r.request_class for r in a] == [r.request_class for r in requests_from_records(records, flex_share=0.3, seed=1)]
    assert [r.request_class for r in a] != [r.request_class for r in requests_from_records(records, flex_share=0.3, seed=2)]
    assert 0.15 < sum(r.request_class == "flex" for r in a) / len(a) < 0.45
    assert {r.request_class for r in requests_from_records(records)} == {"default"}
    with pytest.raises(ValueError):
        requests_from_records(records, flex_share=1.5)


def test_a_trace_line_may_name_its_class(tmp_path: Path):
    lines = [{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2], "service_tier": "priority"},
             {"timestamp": 5, "input_length": 100, "output_length": 4, "hash_ids": [3]},
             {"timestamp": 9, "input_length": 100, "output_length": 4, "hash_ids": [4], "service_tier": "flex"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = load_trace(path)
    assert [r.request_class for r in requests_from_records(records)] == ["priority", "default", "flex"]
    assert [r.request_class for r in requests_from_records(records, flex_share=1.0)] == ["priority", "flex", "flex"]
    path.write_text(json.dumps({**lines[0], "service_tier": "gold"}) + "\n")
    with pytest.raises(TraceError, match=":1: .service_tier"):
        load_trace(path)


def test_interactive_requests_keep_their_slos_ahead_of_flex_work(trace: Path, tmp_path: Path, capsys):
    on = _run(trace, tmp_path / "on.json")
    off = _run(trace, tmp_path / "off.json", "--no-classes")
    assert "flex:" in capsys.readouterr().out
    chat_on, chat_off = on["by_class"]["default"], off["by_class"]["default"]
    flex_on, flex_off = on["by_class"]["flex"], off["by_class"]["flex"]
    assert chat_on["requests"] == chat_off["requests"] and flex_on["requests"] == flex_off["requests"]
    # the same requests, overloaded: with classes the interactive ones go first
    assert chat_off["slo_attainment"] < 0.9
    assert chat_on["slo_attainment"] > chat_off["slo_attainment"]
    # flex work is never refused for the interactive SLOs: it waits (longer), and is served
    assert flex_on["completed"] == flex_on["requests"] > flex_off["completed"]
    assert flex_on["ttft_p90_s"] > chat_on["ttft_p90_s"]
