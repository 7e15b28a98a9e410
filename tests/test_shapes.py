"""The promises a user relies on, in each shape `mooncake serve` gives them: the colocated default
(one colocated instance) and the prefill/decode pair (``--disaggregated``), one cluster per shape
for the module. Greedy output equal to transformers and unchanged by a cache hit (from the
instance's cache and from the store); request classes (a flex flood does not hold an interactive
request back, each response says its class); a session's next turn reusing its prefix (and
``/cluster`` showing its kept blocks per node and per tenant); structured output; past capacity,
a 429 that says why, with Retry-After. Promises that involve placement between kinds (migration
between a colocated instance and a pair, mixed clusters) are in ``test_colocated.py``; failover is
shape-independent at the conductor (``test_failover.py``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mooncake.testing.api import MODEL, complete
from mooncake.testing.cluster import SHAPES, start_cluster, small_config
from mooncake.testing.wait import wait_for
from tests.oracle import greedy

pytestmark = pytest.mark.timeout(900)

QUEUE_WAIT_S = 0.5  # the cluster's [admission] max_queue_wait_s: a burst of long prompts passes it


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp(request.param))
    cfg.engine.profile_at_start = True  # the predictions behind early refusals rest on this machine's numbers
    cfg.admission.max_queue_wait_s = QUEUE_WAIT_S
    c = start_cluster(cfg=cfg, store=1, **SHAPES[request.param])
    c.shape = request.param
    yield c
    c.stop()


def test_greedy_output_equals_transformers_and_a_cache_hit_changes_nothing(cluster, loaded_model, oracle_model):
    tok = loaded_model.tokenizer
    ids = tok(f"In the {cluster.shape} shape, a lighthouse keeper writes a letter: " + "waves and gulls. " * 12)[
        "input_ids"]
    want = tok.decode(greedy(oracle_model, ids, 20))
    first = complete(cluster.url, ids, max_tokens=20)
    assert first.status_code == 200, first.text
    again = complete(cluster.url, ids, max_tokens=20)
    assert [r.json()["choices"][0]["text"] for r in (first, again)] == [want, want]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_a_flex_flood_does_not_hold_an_interactive_request_back(cluster):
    flood = [[2000 + 13 * i + j for j in range(700)] for i in range(4)]

    def flex(prompt: list[int]) -> httpx.Response:
        return complete(cluster.url, prompt, max_tokens=24, service_tier="flex", ignore_eos=True)

    with ThreadPoolExecutor(len(flood)) as pool:
        flooding = [pool.submit(flex, p) for p in flood]
        time.sleep(0.5)  # the flood is queued first
        chat = complete(cluster.url, "A short question: what is two and two?", max_tokens=8, ignore_eos=True)
        chat_done = time.monotonic()
        assert chat.status_code == 200 and chat.json()["service_tier"] == "default", chat.text
        results = [f.result() for f in flooding]
        flood_done = time.monotonic()
    assert all(r.status_code == 200 and r.json()["service_tier"] == "flex" for r in results)
    assert chat_done < flood_done  # served beside the flood, not after it


def test_a_sessions_next_turn_reuses_its_prefix(cluster):
    doc = "Notes on tides and harbours. " * 30
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "session_id": f"s-{cluster.shape}"}
    turn1 = httpx.post(cluster.url + "/v1/chat/completions", timeout=120, json={
        **body, "messages": [{"role": "user", "content": doc + " Summarize."}]})
    assert turn1.status_code == 200, turn1.text
    answer = turn1.json()["choices"][0]["message"]["content"]
    turn2 = httpx.post(cluster.url + "/v1/chat/completions", timeout=120, json={
        **body, "messages": [{"role": "user", "content": doc + " Summarize."},
                             {"role": "assistant", "content": answer},
                             {"role": "user", "content": "Shorter, please."}]})
    assert turn2.status_code == 200, turn2.text
    usage = turn2.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // 2

    def kept_by_the_one_tenant() -> dict | None:  # no API keys: one tenant, ""
        info = httpx.get(cluster.url + "/cluster").json()
        by_role = {n["role"]: n["load"]["kept_by_tenant"].get("", 0) for n in info["nodes"] if n["role"] != "frontend"}
        return info if info["tenants"].get("", {}).get("kept_blocks", 0) and all(by_role.values()) else None

    wait_for(kept_by_the_one_tenant, 20, "/cluster showing the session's kept blocks per node and per tenant")


def test_structured_output_is_valid_json(cluster):
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "Give a JSON object with a name and an age."}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_past_capacity_a_request_that_would_queue_too_long_gets_429_with_retry_after(cluster):
    prompts = [[5000 + 17 * i + j for j in range(1200)] for i in range(8)]

    def send(prompt: list[int]) -> httpx.Response:
        return complete(cluster.url, prompt, max_tokens=2, ignore_eos=True)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(send, prompts))
    refused = [r for r in results if r.status_code != 200]
    assert any(r.status_code == 200 for r in results) and refused, [r.status_code for r in results]
    for r in refused:
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_wait", r.text
        assert "max_queue_wait_s" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
