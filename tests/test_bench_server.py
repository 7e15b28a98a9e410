"""Streaming client, runner, JSON report, CLI and plots against a small in-process
OpenAI-style SSE server (a test fixture: uvicorn + starlette on a free port).

Fake server behaviour, chosen by the request:
- model "busy" or a prompt longer than ``reject_over`` tokens -> 429 (OpenAI error body)
- model "broken" or ``max_tokens == 7`` -> 500; ``max_tokens == 9`` -> an in-stream error
- otherwise ``max_tokens`` chunks " w0", " w1", ... after ``first_delay`` s, ``token_delay`` s
  apart, then a usage chunk with cached tokens from a 16-token block prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from mooncake.bench.__main__ import main as bench_main
from mooncake.bench.arrivals import ArrivalSpec
from mooncake.bench.client import RequestRecord, stream_request
from mooncake.bench.config import BenchConfig
from mooncake.bench.report import Report
from mooncake.bench.runner import run_benchmark
from mooncake.bench.trace import TraceScaling
from mooncake.bench.workloads import SharedPrefixSpec

BLOCK = 16


@dataclass
class FakeState:
    first_delay: float = 0.03
    token_delay: float = 0.004
    reject_over: int = 10_000
    bodies: list = field(default_factory=list)
    seen_blocks: set = field(default_factory=set)
    in_flight: int = 0
    max_in_flight: int = 0


def _prompt_units(body: dict) -> list:
    if "messages" in body:
        return " ".join(m["content"] for m in body["messages"]).split()
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else prompt.split()


def _cached(state: FakeState, units: list) -> int:
    cached = 0
    for end in range(BLOCK, len(units) + 1, BLOCK):
        key = tuple(units[:end])
        if key in state.seen_blocks and cached == end - BLOCK:
            cached = end
        state.seen_blocks.add(key)
    return cached


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "x", "param": None, "code": status}},
                        status_code=status)


def make_app(state: FakeState) -> Starlette:
    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(request: Request):
        body = await request.json()
        state.bodies.append(body)
        chat = request.url.path.endswith("chat/completions")
        units = _prompt_units(body)
        if body["model"] == "busy" or len(units) > state.reject_over:
            return _error(429, "overloaded: try later")
        if body["model"] == "broken" or body["max_tokens"] == 7:
            return _error(500, "boom")
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        n = body["max_tokens"]
        cached = _cached(state, units)

        async def events():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(state.first_delay)
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.token_delay)
                    if n == 9 and i == 2:
                        yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                        return
                    choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": len(units), "completion_tokens": n,
                         "total_tokens": len(units) + n, "prompt_tokens_details": {"cached_tokens": cached}}
                if body["model"] != "nousage":
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"])])


@pytest.fixture
def server():
    """(base_url, state); the server runs in its own thread and event loop."""
    state = FakeState()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def body(model="fake-model", prompt=None, max_tokens=4, **extra):
    b = {"model": model, "prompt": list(range(1000, 1040)) if prompt is None else prompt,
         "max_tokens": max_tokens, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}
    b.update(extra)
    return b


async def one(base, b, path="/v1/completions"):
    rec = RequestRecord(request_id=0, session_id="s", turn=0, start_s=0.0)
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        text = await stream_request(client, path, b, rec)
    return rec, text


async def test_client_parses_stream_and_usage(server):
    base, state = server
    rec, text = await one(base, body(max_tokens=5))
    assert rec.ok and rec.status == 200 and rec.error is None
    assert text == " w0 w1 w2 w3 w4" and rec.output_chars == len(text)
    assert rec.ttft_s >= state.first_delay
    assert len(rec.itl_s) == 4 and all(g >= 0.003 for g in rec.itl_s)
    assert rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-6
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (40, 5, 0)
    assert rec.usage_reported and rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / 4)
    rec2, _ = await one(base, body(max_tokens=2))
    assert rec2.cached_tokens == 32  # two full 16-token blocks seen before


async def test_client_chat_and_missing_usage(server):
    base, _ = server
    rec, text = await one(base, {**body(max_tokens=3), "messages": [{"role": "user", "content": "a b"}]},
                          path="/v1/chat/completions")
    assert rec.ok and text == " w0 w1 w2" and rec.completion_tokens == 3
    rec, _ = await one(base, body(model="nousage", max_tokens=3))
    assert rec.ok and not rec.usage_reported and rec.completion_tokens == 3 and rec.cached_tokens is None


@pytest.mark.parametrize("kwargs, status, message", [
    ({"model": "busy"}, 429, "overloaded: try later"),
    ({"model": "broken"}, 500, "boom"),
    ({"max_tokens": 9}, 200, "engine died"),
])
async def test_client_records_failures(server, kwargs, status, message):
    base, _ = server
    rec, _ = await one(base, body(**kwargs))
    assert not rec.ok and rec.status == status and rec.error == message
    assert rec.rejected == (status == 429)
    assert rec.tpot_s is None


async def test_client_transport_error_does_not_raise():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    rec, text = await one(f"http://127.0.0.1:{port}", body())
    assert not rec.ok and rec.status is None and "ConnectError" in rec.error and text == ""


def write_trace(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 100, "input_length": 1500, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 200, "input_length": 4096, "output_length": 2, "hash_ids": [5, 6, 7, 8, 9, 10, 11, 12]},
    {"timestamp": 300, "input_length": 512, "output_length": 7, "hash_ids": [0]},
    {"timestamp": 400, "input_length": 600, "output_length": 50, "hash_ids": [0, 3]},
]


async def test_runner_trace_replay_and_json_report(server, tmp_path):
    base, state = server
    state.reject_over = 200  # the 8-block request (256 tokens at 32/block) is rejected
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    cfg = BenchConfig(base_url=base, trace_path=str(trace), ignore_eos=True, progress=False,
                      scaling=TraceScaling(block_tokens=32, time_scale=0.5, max_output_tokens=8),
                      goodput_slos_ms={"ttft": 5000}, label="replay")
    report = await run_benchmark(cfg, command=["mooncake", "bench"])
    assert report.model == "fake-model"
    recs = report.records
    assert [r.request_id for r in recs] == [0, 1, 2, 3, 4]
    assert state.bodies[1]["prompt"][:64] == state.bodies[0]["prompt"]
    assert [len(b["prompt"]) for b in state.bodies] == [64, 64 + 30, 256, 32, 32 + 6]  # 88/512 of 32 -> 6
    assert [b["max_tokens"] for b in state.bodies] == [4, 3, 2, 7, 8]
    assert all(b["ignore_eos"] is True and b["temperature"] == 0 for b in state.bodies)
    # arrivals follow the scaled timestamps (50 ms apart)
    assert all(recs[i].start_s >= 0.05 * i - 0.005 for i in range(5))
    assert [r.ok for r in recs] == [True, True, False, False, True]
    assert recs[2].rejected and recs[3].status == 500 and recs[3].error == "boom"
    assert [r.cached_tokens for r in recs if r.ok] == [0, 64, 32]
    s = report.summary
    assert (s["completed"], s["rejected_429"], s["errors"]) == (3, 1, 1)
    assert s["prefix_hit_rate"] == pytest.approx(96 / (64 + 94 + 38))
    assert s["good_requests"] == 3 and s["duration_s"] >= 0.2
    assert s["total_output_tokens"] == 4 + 3 + 8

    out = tmp_path / "r.json"
    report.save(out)
    data = json.loads(out.read_text())
    assert set(data) >= {"version", "label", "model", "command", "config", "summary", "records"}
    assert data["command"] == ["mooncake", "bench"] and data["label"] == "replay"
    assert data["config"]["scaling"]["block_tokens"] == 32 and data["config"]["arrival"]["kind"] == "trace"
    assert data["records"][0]["tpot_s"] is not None and len(data["records"]) == 5
    again = Report.load(out)
    assert again.summary == data["summary"] and again.records[1].itl_s == recs[1].itl_s


async def test_runner_multi_turn_chat_history(server):
    base, state = server
    spec = SharedPrefixSpec(groups=2, sessions_per_group=2, prefix_tokens=32, suffix_tokens=4,
                            turns=3, output_tokens=2)
    cfg = BenchConfig(base_url=base, model="m", workload="shared-prefix", shared_prefix=spec,
                      endpoint="chat", prompt_mode="text", progress=False)
    report = await run_benchmark(cfg)
    assert report.summary["completed"] == 12
    last = [b for b in state.bodies if len(b["messages"]) == 5]
    assert len(last) == 4
    for b in last:
        assert [m["role"] for m in b["messages"]] == ["user", "assistant", "user", "assistant", "user"]
        assert b["messages"][1]["content"] == " w0 w1" == b["messages"][3]["content"]
    firsts = [b["messages"][0]["content"] for b in state.bodies if len(b["messages"]) == 1]
    g0 = [c for c in firsts if c.split()[:32] == firsts[0].split()[:32]]
    assert len(firsts) == 4 and len(g0) == 2  # sessions of a group share the 32-word prefix
    assert report.summary["prefix_hit_rate"] > 0


async def test_runner_multi_turn_token_prompts_concatenate(server):
    base, state = server
    spec = SharedPrefixSpec(groups=1, sessions_per_group=1, prefix_tokens=8, suffix_tokens=2,
                            turns=2, output_tokens=3)

    def encode(text: str) -> list[int]:
        return [2000 + int(w[1:]) for w in text.split()]

    cfg = BenchConfig(base_url=base, workload="shared-prefix", shared_prefix=spec, progress=False)
    report = await run_benchmark(cfg, encode=encode)
    first, second = (b["prompt"] for b in state.bodies)
    assert len(first) == 10 and second[:10] == first and second[10:13] == [2000, 2001, 2002]
    assert len(second) == 15 and report.records[1].turn == 1


async def test_runner_rate_concurrency_and_limits(server):
    base, state = server
    spec = SharedPrefixSpec(groups=2, sessions_per_group=4, prefix_tokens=16, suffix_tokens=4,
                            output_tokens=3)
    cfg = BenchConfig(base_url=base, workload="shared-prefix", shared_prefix=spec, progress=False,
                      arrival=ArrivalSpec(kind="concurrency", concurrency=2))
    report = await run_benchmark(cfg)
    assert report.summary["completed"] == 8 and state.max_in_flight == 2

    cfg = BenchConfig(base_url=base, workload="shared-prefix", shared_prefix=spec, progress=False,
                      arrival=ArrivalSpec(kind="rate", rate=40.0), max_requests=5)
    report = await run_benchmark(cfg)
    starts = [r.start_s for r in report.records]
    assert len(starts) == 5 and all(starts[i] >= i / 40 - 0.005 for i in range(5))

    cfg = BenchConfig(base_url=base, workload="shared-prefix", shared_prefix=spec, progress=False,
                      arrival=ArrivalSpec(kind="rate", rate=10.0), duration_s=0.25)
    report = await run_benchmark(cfg)
    assert 2 <= report.summary["requests"] <= 3  # sends at 0, 100, 200 ms; none at 300 ms


def test_cli_run_then_plot(server, tmp_path, capsys):
    base, _ = server
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    outs = []
    for label, scale in (("fast", 0.1), (None, 0.2)):
        out = tmp_path / f"run-{scale}.json"
        argv = ["--url", base, "--trace", str(trace), "--block-tokens", "16", "--time-scale", str(scale),
                "--max-output-tokens", "4", "--goodput", "ttft:1000", "tpot:100", "--out", str(out)]
        assert bench_main(argv + (["--label", label] if label else [])) == 0
        outs.append(out)
    stdout = capsys.readouterr().out
    assert "TTFT" in stdout and "Goodput" in stdout and "Prefix hit rate" in stdout
    data = json.loads(outs[0].read_text())
    assert data["summary"]["goodput"] is not None and data["config"]["goodput_slos_ms"]["ttft"] == 1000

    assert bench_main(["plot", *map(str, outs), "--out", str(tmp_path / "figs")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "figs").glob("*.png"))
    assert pngs == ["latency_over_time.png", "summary.png", "tpot_cdf.png", "ttft_cdf.png"]
    for p in (tmp_path / "figs").glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_cli_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    assert bench_main(["--trace", str(bad), "--url", "http://127.0.0.1:9"]) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert bench_main(["--endpoint", "chat", "--prompt-mode", "tokens"]) == 2
    assert bench_main(["plot", str(bad), "--out", str(tmp_path / "f")]) == 2
