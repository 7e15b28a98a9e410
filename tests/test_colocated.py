"""Colocated instances in a real cluster beside a prefill/decode pair: greedy output equal to
transformers in float32 on both kinds (round_robin sends requests to each in turn), a prompt
prefilled on the pair and then served by the colocated instance from the store, concurrent
requests whose prompt chunks share steps with others' decoding, and a mixed dev cluster's
/cluster view; a request migrated from a colocated instance that dies to the pair, and from the
pair's decode that dies to the colocated instance (the module's last test: it kills and restarts
roles).
Shapes: mixed (a colocated instance beside a pair): placement and migration between kinds."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mooncake.sched.colocated_budget import DEFAULT_TBT_TARGET_MS
from mooncake.testing.api import MODEL, complete, metric, metrics, stream, stream_text
from mooncake.testing.cluster import start_cluster
from mooncake.testing.wait import wait_for
from tests.oracle import greedy

pytestmark = pytest.mark.timeout(900)
N = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("data"), prefill=1, decode=1, store=1, colocated=1,
                      policy="round_robin")
    yield c
    c.stop()


def _dispatched(text: str) -> dict[str, float]:
    return {n: metric(text, "mooncake:prefill_dispatched_total", instance=n)
            for n in ("node0-prefill", "node0-colocated")}


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def test_both_kinds_serve_exactly_and_a_prefix_moves_through_the_store(cluster, loaded_model, oracle_model):
    tok = loaded_model.tokenizer
    doc = tok("A colocated instance prefills and decodes in one engine. " * 8)["input_ids"]
    before = metrics(cluster.url)
    outs = []
    for i in range(4):  # the same document, four questions: each kind serves two
        ids = doc + tok(f" Question {i}: why?")["input_ids"]
        r = complete(cluster.url, ids, max_tokens=N)
        assert r.status_code == 200, r.text
        outs.append(r.json())
        assert r.json()["choices"][0]["text"] == _text(tok, greedy(oracle_model, ids, N)), i
    after = metrics(cluster.url)
    served = {n: after_n - _dispatched(before)[n] for n, after_n in _dispatched(after).items()}
    assert served == {"node0-prefill": 2, "node0-colocated": 2}
    # the document's blocks were computed once (by the first request) and reused by the others,
    # on the colocated instance first from the store
    cached = [o["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for o in outs]
    assert cached[0] == 0 and all(c >= len(doc) // 16 * 16 - 16 for c in cached[1:]), cached


def test_concurrent_prompts_share_steps_with_decoding(cluster, loaded_model, oracle_model):
    tok = loaded_model.tokenizer
    prompts = [tok(f"Story {i}: " + "the quick brown fox jumps over the lazy dog. " * (2 + 6 * i))["input_ids"]
               for i in range(6)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i: int) -> httpx.Response:
                await asyncio.sleep(0.3 * i)  # later prompts arrive while earlier ones decode
                body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 24, "temperature": 0}
                return await client.post(cluster.url + "/v1/completions", json=body)
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    for ids, r in zip(prompts, asyncio.run(run())):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _text(tok, greedy(oracle_model, ids, 24))


def test_cluster_view_shows_the_colocated_instance(cluster):
    view = httpx.get(cluster.url + "/cluster", timeout=10).json()
    roles = {n["role"] for n in view["nodes"]}
    assert {"prefill", "decode", "colocated", "store"} <= roles
    colocated = next(n for n in view["nodes"] if n["role"] == "colocated")
    # no fixed budget: each step's prompt tokens keep it within the default target (no profile in tests)
    assert colocated["step_tokens"] == 0 and colocated["step_target_ms"] == DEFAULT_TBT_TARGET_MS
    health = httpx.get(cluster.url + "/health", timeout=10).json()
    assert health["nodes"]["colocated"] == 1


@pytest.mark.parametrize("first, second", [("colocated", "decode"), ("decode", "colocated")])
def test_a_request_migrates_between_a_colocated_instance_and_a_pair(cluster, loaded_model, oracle_model,
                                                                   first, second):
    """Only ``first``'s kind can serve when the request starts (the other kind's process is stopped
    and comes back while it streams); then ``first``'s process is killed, and the request resumes
    on the other kind, with output unchanged."""
    tok = loaded_model.tokenizer
    ids = tok(f"Migration from the {first} instance: a long story about a lighthouse keeper.")["input_ids"]
    want = _text(tok, greedy(oracle_model, ids, 160))
    stopped = "colocated0" if first != "colocated" else "decode0"
    cluster.kill(stopped)
    wait_for(lambda: httpx.get(cluster.url + "/health", timeout=5).json()["nodes"][second] == 0, 30,
             f"{stopped} to be declared dead")
    before = metric(metrics(cluster.url), "mooncake:migrations_total")
    restarted = []

    def on_event(n: int, event: object) -> None:
        if n == 8 and not restarted:  # streaming on ``first``: the other kind comes back, then ``first`` dies
            cluster.spawn(stopped[:-1], 0)
            cluster.wait_ready(120, {second: 1})
            cluster.kill(f"{first}0")
            restarted.append(True)

    events = stream(cluster.url, {"model": MODEL, "prompt": ids, "max_tokens": 160, "temperature": 0,
                                  "ignore_eos": True}, on_event, timeout=300)
    assert restarted and stream_text(events) == want
    assert metric(metrics(cluster.url), "mooncake:migrations_total") == before + 1
    cluster.spawn(first, 0)
    cluster.wait_ready(120, {"prefill": 1, "decode": 1, "colocated": 1})
