"""``--calibrate URL``: the cost figures of a (fake) cluster's ``GET /cluster``, over real HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mooncake.cli import main
from mooncake.sim.calibrate import CalibrationError, calibrated_hardware, fetch_cluster
from mooncake.sim.synthetic import ChatTraceSpec, chat_trace, write_trace

TODAY = {"model": "m", "index_blocks": 0, "requests": 0,
         "estimates": {"prefill_1k_tokens_s": 0.5, "decode_step_batch_8_s": 0.046},
         "nodes": [{"node_id": "p", "role": "prefill", "name": "n0", "endpoints": {}, "load": {}}]}


@pytest.fixture
def server():
    """A local HTTP server answering /cluster with ``state['body']``; ``state['key']`` guards it."""
    state: dict = {"body": TODAY, "key": None, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            state["paths"].append(self.path)
            if state["key"] and self.headers.get("Authorization") != f"Bearer {state['key']}":
                self.send_response(401)
                self.end_headers()
                return
            body = state["body"] if isinstance(state["body"], bytes) else json.dumps(state["body"]).encode()
            self.send_response(200 if self.path == "/cluster" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_today_fields_give_linear_costs(server) -> None:
    hw = calibrated_hardware(fetch_cluster(server["url"] + "/"), block_tokens=16)
    assert server["paths"] == ["/cluster"]
    assert hw.prefill_s(1000, 0) == pytest.approx(0.5)
    assert hw.decode_step_s(8, 0) == pytest.approx(0.046)
    assert hw.decode_step_s(16, 0) > hw.decode_step_s(8, 0)
    assert hw.prefill_prior()[0] == pytest.approx(2000)
    assert hw.caps.prefill_cache_blocks > 10**9  # not reported: unbounded


def test_richer_fields_are_used_when_present(server) -> None:
    body = json.loads(json.dumps(TODAY))
    body["block_tokens"] = 16
    body["estimates"].update(prefill_fixed_s=0.1, prefill_per_token_s=0.0004, prefill_per_pair_s=1e-8,
                             decode_step_s=0.02, decode_per_seq_s=0.003, fetch_block_s=0.001)
    body["nodes"] = [{"role": "prefill", "num_blocks": 4096, "block_bytes": 1000},
                     {"role": "store", "load": {"tiers": {"dram": {"capacity_bytes": 64000},
                                                         "lmdb": {"capacity_bytes": 320000}}}}]
    server["body"] = body
    hw = calibrated_hardware(fetch_cluster(server["url"]), block_tokens=64)
    assert hw.decode_step_s(10, 0) == pytest.approx(0.05)
    assert hw.prefill_s(100, 0) == pytest.approx(0.1 + 0.04 + 100 * 50 * 1e-8)
    assert hw.fetch_block_s("dram", False) == pytest.approx(0.004)  # 4 engine blocks per simulated block
    assert hw.caps.prefill_cache_blocks == 1024
    assert (hw.caps.store_dram_blocks, hw.caps.store_lmdb_blocks) == (16, 80)
    body["nodes"][0]["kv_block_bytes"] = 500  # blocks stored encoded ([model] kv_codec): twice as many fit
    hw = calibrated_hardware(fetch_cluster(server["url"]), block_tokens=64)
    assert (hw.caps.store_dram_blocks, hw.caps.store_lmdb_blocks) == (32, 160)
    assert hw.caps.prefill_cache_blocks == 1024  # the pool's blocks are not encoded


def test_api_key_is_sent_and_a_refusal_names_it(server) -> None:
    server["key"] = "sekrit"
    with pytest.raises(CalibrationError, match="HTTP 401.*--api-key"):
        fetch_cluster(server["url"])
    assert fetch_cluster(server["url"], api_key="sekrit")["estimates"]


@pytest.mark.parametrize("body, message", [
    (b"<html>", "not JSON"),
    ([1, 2], "JSON object"),
    ({"nodes": []}, "no 'estimates'"),
    ({"estimates": {"prefill_1k_tokens_s": 0.5}}, "decode_step_batch_8_s"),
    ({"estimates": {"prefill_1k_tokens_s": "fast", "decode_step_batch_8_s": 0.1}}, "prefill_1k_tokens_s"),
])
def test_bad_answers_are_clear_errors(server, body, message) -> None:
    server["body"] = body
    with pytest.raises(CalibrationError, match=message):
        calibrated_hardware(fetch_cluster(server["url"]), 16)


def test_cli_run_with_calibrate(server, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(chat_trace(ChatTraceSpec(conversations=10, system_prompts=2, seed=1)), trace)
    out = tmp_path / "r.json"
    server["key"] = "k"
    args = ["sim", "run", "--trace", str(trace), "--block-tokens", "16", "--prefill", "1", "--decode", "1",
            "--calibrate", server["url"], "--max-requests", "20", "--json", str(out)]
    assert main(args) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main(args + ["--api-key", "k"]) == 0
    res = json.loads(out.read_text())
    assert res["requests"] == 20 and res["profile"].startswith("calibrated:") and res["ttft_mean_s"] > 0
