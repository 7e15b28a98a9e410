"""A request's life under pressure, on real dev clusters: a decode pool overfilled by
concurrent long requests (preemption), a worker whose engine is stuck (stall detection),
and a dev cluster whose parent is killed (no orphaned roles). Greedy output is checked
against transformers.
Shapes: preemption in each shape (a test each); stall detection and orphans in the pair, whose roles
it restarts by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mooncake.testing.api import MODEL, complete, metric, metrics, stream, stream_text
from mooncake.testing.cluster import running_cluster, small_config
from mooncake.testing.ports import free_port
from mooncake.testing.wait import wait_for
from mooncake.roles.engine_host import STALL_ENV

from oracle import greedy

pytestmark = pytest.mark.timeout(420)

TEXTS = ["The history of astronomy begins with the earliest recorded observations of the night sky.",
         "A recipe for bread: flour, water, salt and yeast, mixed and left to rise overnight.",
         "In distributed systems, consensus protocols let a group of machines agree on one value.",
         "The river wound through the valley, past farms and villages, towards the distant sea."]


def prompts(tokenizer, n_tokens: int) -> list[list[int]]:
    return [(tokenizer.encode(t) * 20)[:n_tokens] for t in TEXTS]


def test_an_overfilled_decode_pool_preempts_and_every_request_matches_transformers(
        tmp_path, loaded_model, oracle_model):
    """Four requests of 60 prompt + 80 generated tokens need 4 x 9 blocks; the decode pool
    has 24. Reservation holds the KV of all four prompts (4 x 4 blocks); as they grow, the
    newest are preempted (their KV written to the store) and resumed later, with unchanged output."""
    cfg = small_config(tmp_path)
    cfg.engine.kv_cache_bytes = 24 * 737_280  # 24 blocks of SmolLM2 (float32, 16 tokens)
    tok = loaded_model.tokenizer
    ps = prompts(tok, 60)
    expected = [tok.decode(greedy(oracle_model, p, 80), skip_special_tokens=True) for p in ps]
    with running_cluster(cfg=cfg) as c:
        def run(p: list[int]) -> httpx.Response:
            return complete(c.url, p, max_tokens=80, ignore_eos=True)

        with ThreadPoolExecutor(len(ps)) as pool:
            responses = list(pool.map(run, ps))
        for r, want in zip(responses, expected):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            assert r.json()["usage"]["completion_tokens"] == 80
        text = metrics(c.url)
        assert metric(text, "mooncake:preemptions_total") >= 1
        assert metric(text, "mooncake:requests_total", outcome="ok") == len(ps)


def test_an_overfilled_colocated_pool_preempts_and_every_request_matches_transformers(
        tmp_path, loaded_model, oracle_model):
    """The same on one colocated instance: its prompts compute into the blocks they decode from;
    as the sequences grow past its 24 blocks the newest are preempted and resumed from the store."""
    cfg = small_config(tmp_path)
    cfg.engine.kv_cache_bytes = 24 * 737_280
    tok = loaded_model.tokenizer
    ps = prompts(tok, 60)
    expected = [tok.decode(greedy(oracle_model, p, 80), skip_special_tokens=True) for p in ps]
    with running_cluster(prefill=0, decode=0, colocated=1, cfg=cfg) as c:
        with ThreadPoolExecutor(len(ps)) as pool:
            responses = list(pool.map(lambda p: complete(c.url, p, max_tokens=80, ignore_eos=True), ps))
        for r, want in zip(responses, expected):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        text = metrics(c.url)
        assert metric(text, "mooncake:preemptions_total") >= 1
        assert metric(text, "mooncake:requests_total", outcome="ok") == len(ps)


def test_a_stalled_engine_is_marked_unhealthy_and_its_request_completes_elsewhere(
        tmp_path, loaded_model, oracle_model):
    cfg = small_config(tmp_path, stall_after_s=3.0, heartbeat_s=0.5, drain_timeout_s=1.0)
    prompt = prompts(loaded_model.tokenizer, 40)[0]
    want = loaded_model.tokenizer.decode(greedy(oracle_model, prompt, 24), skip_special_tokens=True)
    with running_cluster(prefill=1, decode=1, store=1, cfg=cfg) as c:
        # decode0 again, with an engine that hangs at its 4th call (reserve, then KV writes: layer-wise,
        # one per layer, so it hangs while the KV lands, with work pending);
        # then decode1, registered after it: with both idle, the scheduler picks decode0 first.
        c.kill("decode0")
        c.spawn("decode", 0, env={STALL_ENV: "3"})
        wait_for(lambda: any(n["node_id"] == "node0-decode" and n["pid"] == c.children["decode0"].pid
                             for n in httpx.get(c.url + "/cluster").json()["nodes"]), 120, "decode0 to re-register")
        c.spawn("decode", 1)
        c.wait_ready(120, {"decode": 2})
        on_stalled: list[str] = []

        def first_decode(n: int, _: object) -> None:
            if n == 1:  # the first token came from prefill; decoding is on the stalled instance
                nodes = httpx.get(c.url + "/cluster").json()["nodes"]
                on_stalled.extend(d["node_id"] for d in nodes if d["role"] == "decode" and d["assigned"])

        events = stream(c.url, {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True}, first_decode)
        assert on_stalled == ["node0-decode"]
        assert events[-1] == "[DONE]" and stream_text(events) == want
        node = next(n for n in httpx.get(c.url + "/cluster").json()["nodes"] if n["node_id"] == "node0-decode")
        assert node["stalled"] and httpx.get(c.url + "/health").json()["nodes"]["decode"] == 1
        assert metric(metrics(c.url), "mooncake:migrations_total") >= 1
        assert complete(c.url, "Still serving", max_tokens=2).status_code == 200


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_dev_roles_exit_when_the_dev_process_is_killed(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dev = subprocess.Popen([sys.executable, "-m", "mooncake.cli", "serve", "--dev", "--port", str(port),
                            "--data-dir", str(tmp_path), "--log-level", "warning"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "ready" in dev.stdout.readline()
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(dev.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        assert len(children) == 3  # conductor, store, colocated (the single-machine default)
        dev.send_signal(signal.SIGKILL)
        dev.wait(timeout=10)
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in children if _alive(p)], "role processes outlived mooncake serve --dev"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if dev.poll() is None:
            dev.kill()
        for p in children if "children" in locals() else []:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
