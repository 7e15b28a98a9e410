"""A real dev cluster (2 prefill on node0/node1, 1 decode, 2 stores) as subprocesses:
outputs against transformers, SSE, chat, prefix reuse, routing, replication, bad input,
disconnects.
Shapes: the pair only: routing between two prefill instances and replication between two stores
(exactness and reuse in each shape: test_shapes.py)."""

from __future__ import annotations

import httpx
import pytest
import torch

from mooncake.testing.api import MODEL, complete, metric, metrics, sse_events, stream
from mooncake.testing.cluster import running_cluster
from mooncake.testing.wait import wait_for
from mooncake.tiers.client import StoreClient

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("data"), prefill=2, decode=1, store=2,
                         hot_block_hits=3, replicas=2) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


def oracle_text(oracle_model, tokenizer, ids: list[int], n: int) -> str:
    with torch.no_grad():
        out = oracle_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def test_burst_of_short_prompts_prefills_together_and_matches_transformers(cluster, oracle_model, tokenizer):
    """Concurrent prompts share prefill forwards (``max_prefill_batch``); output is unchanged."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Item {i}: the best way to learn {topic} is" for i, topic in
               enumerate(["chess", "piano", "French", "cooking", "painting", "running", "algebra", "sailing"])]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: complete(cluster.url, p, max_tokens=12), prompts))
    for p, r in zip(prompts, responses):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == oracle_text(oracle_model, tokenizer, tokenizer.encode(p), 12)


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):\n   "])
def test_greedy_completion_matches_transformers(cluster, oracle_model, tokenizer, prompt):
    r = complete(cluster.url, prompt, max_tokens=24)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = oracle_text(oracle_model, tokenizer, tokenizer.encode(prompt), 24)
    assert body["choices"][0]["text"] == expected
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_streaming_is_valid_sse_ending_with_done(cluster, oracle_model, tokenizer):
    prompt = "Once upon a time"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text.split("\n"))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(e["object"] == "text_completion" for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(e["choices"][0]["text"] for e in chunks)
    assert text == oracle_text(oracle_model, tokenizer, tokenizer.encode(prompt), 12)
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12


def test_chat_applies_the_chat_template(cluster, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200, r.text
    chat = r.json()
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(templated, add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == len(ids)
    plain = complete(cluster.url, ids, max_tokens=10).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": plain["choices"][0]["text"]}
    assert chat["object"] == "chat.completion"


def test_prefix_reuse_hits_and_never_changes_output(cluster, oracle_model, tokenizer):
    shared = list(range(2000, 3040))  # 1,040 tokens = 65 blocks of 16
    first = complete(cluster.url, shared + [500, 501, 502], max_tokens=8)
    assert first.status_code == 200
    second_prompt = shared + [900, 901, 902, 903]
    second = complete(cluster.url, second_prompt, max_tokens=8).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(shared)
    assert second["choices"][0]["text"] == oracle_text(oracle_model, tokenizer, second_prompt, 8)


def test_second_chat_turn_hits_first_turn_blocks(cluster):
    turn1 = [{"role": "system", "content": "You are a helpful assistant. " * 20},
             {"role": "user", "content": "Tell me about the moon."}]
    r1 = httpx.post(cluster.url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": turn1, "max_tokens": 20, "temperature": 0}).json()
    turn2 = turn1 + [r1["choices"][0]["message"], {"role": "user", "content": "And the sun?"}]
    r2 = httpx.post(cluster.url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": turn2, "max_tokens": 5, "temperature": 0}).json()
    first_prompt = r1["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= (first_prompt // 16) * 16


def test_a_sessions_prefix_is_kept_where_it_is_cached_and_stored(cluster):
    """A turn naming a session (``session_id``) leaves its blocks kept on the prefill
    and in the store it writes to; the conductor has the stores keep a prefix stored before."""

    def kept() -> tuple[int, int]:
        nodes = httpx.get(cluster.url + "/cluster").json()["nodes"]
        return (sum(n["load"].get("kept_blocks", 0) for n in nodes if n["role"] == "prefill"),
                sum(t.get("session_blocks", 0) for n in nodes if n["role"] == "store"
                    for t in n["load"]["tiers"].values()))

    def ask(system: str, **session: str) -> int:
        r = httpx.post(cluster.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 2, "temperature": 0, **session,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"] // 16

    start = kept()
    blocks = ask("You are a lighthouse keeper who answers in riddles. " * 12, session_id="agent-7")
    wait_for(lambda: (lambda k: k if min(k[0] - start[0], k[1] - start[1]) >= blocks else None)(kept()), 20,
             "the session's blocks kept on the prefill and in a store")
    def stored() -> int:
        return sum(n["blocks_indexed"] for n in httpx.get(cluster.url + "/cluster").json()["nodes"]
                   if n["role"] == "store")

    plain, was = "You are a ferry captain who speaks only of tides. " * 12, stored()
    n = ask(plain)  # cached and stored, but kept by no session
    wait_for(lambda: stored() >= was + n, 20, "the prompt's blocks stored and indexed")
    before = kept()
    more = ask(plain, session_id="agent-8")  # the same prefix, now a session's: the stores holding it keep it
    wait_for(lambda: (lambda k: k if k[1] - before[1] >= more - 1 else None)(kept()), 20,
             "the stored prefix kept by the conductor's Keep")


def test_cache_aware_routes_to_the_prefix_owner(cluster):
    prefix = list(range(5000, 5800))
    before = metrics(cluster.url)
    complete(cluster.url, prefix + [1, 2, 3], max_tokens=2)
    mid = metrics(cluster.url)
    owner = next(n for n in ("node0-prefill", "node1-prefill")
                 if metric(mid, "mooncake:prefill_dispatched_total", instance=n)
                 > metric(before, "mooncake:prefill_dispatched_total", instance=n))
    for i in range(3):
        r = complete(cluster.url, prefix + [10 + i, 11, 12], max_tokens=2)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 784
    after = metrics(cluster.url)
    grew = metric(after, "mooncake:prefill_dispatched_total", instance=owner) \
        - metric(mid, "mooncake:prefill_dispatched_total", instance=owner)
    assert grew == 3


def test_hot_prefix_is_replicated_to_the_other_store(cluster):
    import asyncio

    prefix = list(range(7000, 7320))  # 20 blocks
    stores = [n for n in httpx.get(cluster.url + "/cluster").json()["nodes"] if n["role"] == "store"]
    assert len(stores) == 2

    async def held() -> list[int]:
        from mooncake.blocks import hash_blocks

        hashes = hash_blocks(prefix, 16, model_id(cluster))
        counts = []
        for s in stores:
            c = StoreClient(s["endpoints"]["store"])
            try:
                counts.append(sum(await c.exists(hashes)))
            finally:
                c.close()
        return counts

    # A request hits the prefix once the conductor knows it holds it (the holders' events come with their
    # heartbeats, late on a loaded machine): four hits make it hot, however many requests that takes.
    for i in range(12):
        assert complete(cluster.url, prefix + [100 + i], max_tokens=1).status_code == 200
        if i >= 4 and min(asyncio.run(held())) == 20:
            break
    counts = wait_for(lambda: (lambda c: c if min(c) == 20 else None)(asyncio.run(held())), 20,
                      "a replica on both stores")
    assert counts == [20, 20]
    assert metric(metrics(cluster.url), "mooncake:replications_total") >= 20


def model_id(cluster) -> str:
    return httpx.get(cluster.url + "/v1/models").json()["data"][0]["model_id"]


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": 7}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"1": 5}, "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL, "prompt": list(range(1000, 9500))}, 400, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"model": MODEL, "messages": []}, 400, None),
])
def test_bad_input_gets_openai_error_and_server_keeps_serving(cluster, body, status, param):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(cluster.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(cluster.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param), err
    assert complete(cluster.url, "Hello", max_tokens=2).status_code == 200


def test_disconnected_stream_frees_kv_and_slots_everywhere(cluster):
    body = {"model": MODEL, "prompt": list(range(3000, 3300)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stream(cluster.url, body, lambda n, _: n >= 3)
    # The client is gone: every role must drop the request and its blocks.

    def idle():
        info = httpx.get(cluster.url + "/cluster").json()
        workers = [n for n in info["nodes"] if n["role"] in ("prefill", "decode")]
        return info["requests"] == 0 and all(
            n["load"].get("used_blocks") == 0 and n["load"].get("sequences") == 0 and n["assigned"] == 0
            for n in workers)

    wait_for(idle, 15, "all KV and slots freed")
    assert metric(metrics(cluster.url), "mooncake:requests_total", outcome="aborted") >= 1


def test_non_streaming_client_that_gives_up_frees_the_request(cluster):
    # 2,000 tokens: far longer than the client's 3 s even on a GPU (~150 tokens/s at batch 1)
    body = {"model": MODEL, "prompt": list(range(3000, 3100)), "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True}
    before = metric(metrics(cluster.url), "mooncake:requests_total", outcome="aborted")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(cluster.url + "/v1/completions", json=body, timeout=3)

    def idle():
        info = httpx.get(cluster.url + "/cluster").json()
        return info["requests"] == 0 and all(n["load"].get("used_blocks") == 0 for n in info["nodes"]
                                             if n["role"] in ("prefill", "decode"))

    wait_for(idle, 15, "the abandoned request to be freed")
    assert metric(metrics(cluster.url), "mooncake:requests_total", outcome="aborted") == before + 1
