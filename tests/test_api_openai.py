"""The OpenAI Python SDK, unchanged, against one dev cluster: n choices, logprobs, structured
output, tool calls, penalties, min_tokens; the new endpoints and the 400s of bad values.
Shapes: the pair only: the API is the frontend's and sampling the same engine code in each shape
(test_shapes.py runs classes, sessions and structured output in each)."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from mooncake.testing.api import MODEL, metric, metrics
from mooncake.testing.cluster import running_cluster

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                           "likes": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                     "maxItems": 3}},
          "required": ["name", "age", "likes"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person who likes the sea."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("data"), prefill=1, decode=1, store=0, use_store=False) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_n_choices_share_the_prompt_kv(cluster, client):
    prompt = "Once upon a time, in a harbour town far away, " * 6  # several full KV blocks
    hits = metric(metrics(cluster.url), "mooncake:prefix_cache_hits_total")
    r = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and all(c.text for c in r.choices)
    assert r.usage.completion_tokens == 16
    # the second choice took the prompt's full blocks from the cache instead of computing them
    full = (r.usage.prompt_tokens - 1) // 16 * 16
    assert metric(metrics(cluster.url), "mooncake:prefix_cache_hits_total") - hits >= full > 0
    again = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=8, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeds reproduce each choice
    stream = client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=6, temperature=1.0,
                                            stream=True)
    finished = {c.index for chunk in stream for c in chunk.choices if c.finish_reason}
    assert finished == {0, 1}


def test_chat_logprobs_with_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
    assert "".join(e.token for e in content).strip() == r.choices[0].message.content.strip()
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content[:4]]


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sky is" + r.choices[0].text


def test_json_schema_response_validates(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    obj = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_named_and_required_tool_calls_validate(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                              tools=[WEATHER], tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    for c in required.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])
    # the conversation goes on with the call and its result
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    done = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=8, temperature=0, tools=[WEATHER])
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_penalties_and_min_tokens_are_honoured(cluster, client):
    prompt = "List the numbers: one, two, one, two, one, two,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    penalized = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized.choices[0].text != plain.choices[0].text
    ids = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "prompt": prompt + plain.choices[0].text,
                                                      "add_special_tokens": False}).json()["tokens"]
    prompt_ids = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "prompt": prompt,
                                                             "add_special_tokens": False}).json()["tokens"]
    first_id = ids[len(prompt_ids)]
    stopped = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=16, temperature=0,
                                        extra_body={"stop_token_ids": [first_id]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=16, temperature=0,
                                     extra_body={"stop_token_ids": [first_id], "min_tokens": 6})
    assert held.usage.completion_tokens >= 6


def test_tokenize_detokenize_and_request_id(cluster):
    r = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"},
                   headers={"X-Request-Id": "trace-42"})
    body = r.json()
    assert r.headers["x-request-id"] == "trace-42"
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
    chat = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "messages": ASK}).json()
    assert chat["count"] > body["count"]
    back = httpx.post(cluster.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    bad = httpx.post(cluster.url + "/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(cluster.url + "/tokenize", json={"model": MODEL}).status_code == 400
    assert httpx.post(cluster.url + "/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    made_up = httpx.get(cluster.url + "/v1/models").headers["x-request-id"]
    assert len(made_up) == 32


@pytest.mark.parametrize("extra,param", [
    ({"n": 0}, "n"), ({"n": 2, "temperature": 0}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_p": -0.1}, "min_p"), ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"), ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"service_tier": "scale"}, "service_tier"), ({"priority": 1.5}, "priority"), ({"priority": 2**31}, "priority"),
    ({"session_id": ""}, "session_id"), ({"session_id": "s" * 257}, "session_id"), ({"user": 7}, "user"),
])
def test_bad_values_are_400s_that_name_the_option(cluster, extra, param):
    r = httpx.post(cluster.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                               **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"] or "").startswith(param) and err["message"], err


def test_the_response_says_the_class_served(cluster, client):
    """``service_tier`` as OpenAI answers it: ``auto`` and none are served as ``default``; the
    by-class series count each class apart."""
    before = metrics(cluster.url)
    for asked, served in ((None, "default"), ("auto", "default"), ("flex", "flex"), ("priority", "priority")):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                           **({"service_tier": asked} if asked else {}))
        assert r.service_tier == served, asked
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"priority": -3,
                                                                                        "service_tier": "flex"})
    assert r.model_extra["service_tier"] == "flex"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0,
                                                 service_tier="flex", stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks and all(c.service_tier == "flex" for c in chunks)
    after = metrics(cluster.url)

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("mooncake:request_class_requests_total", request_class="flex", outcome="ok") == 3
    assert grew("mooncake:request_class_requests_total", request_class="default", outcome="ok") == 2
    assert grew("mooncake:request_class_requests_total", request_class="priority", outcome="ok") == 1
    assert grew("mooncake:request_class_time_to_first_token_seconds_count", request_class="flex") == 3
    assert grew("mooncake:request_class_inter_token_latency_seconds_count", request_class="flex") >= 3
    # the last release's names (label service_tier), deprecated, still counted for one release
    assert grew("mooncake:class_requests_total", service_tier="flex", outcome="ok") == 3
    assert grew("mooncake:class_time_to_first_token_seconds_count", service_tier="flex") == 3


def test_echo_with_logprobs_and_messages_without_content_are_refused(client):
    with pytest.raises(BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, logprobs=1)
    with pytest.raises(BadRequestError, match="content"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}], max_tokens=2)


def test_a_token_prompt_past_the_context_is_refused_before_its_echo_is_decoded(cluster):
    limit = httpx.get(cluster.url + "/v1/models").json()["data"][0]["max_model_len"]
    for n in (limit, 4 * limit):
        r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": [1000] * n, "echo": True,
                                                               "max_tokens": 1}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and err["code"] == "context_length_exceeded", r.text
        assert f"has {n} tokens" in err["message"]
    for bad in ([True, 5], [5, -1], [[7, 1.5]]):  # a token id is a non-negative integer, not a bool or a float
        r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": bad, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.text


def test_a_non_streamed_response_too_large_to_hold_is_refused_before_any_work(cluster):
    """n=16 with 20 top logprobs over a whole context would be held whole (hundreds of MB) before
    its first byte: a 400 naming n; streamed, or with a small max_tokens, it is served."""
    body = {"model": MODEL, "messages": ASK, "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 8000}
    before = metric(metrics(cluster.url), "mooncake:generation_tokens_total")
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and err["code"] == "response_too_large", r.text
    assert "stream" in err["message"]
    small = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "n": 2, "max_tokens": 2}, timeout=60)
    assert small.status_code == 200 and len(small.json()["choices"]) == 2
    assert metric(metrics(cluster.url), "mooncake:generation_tokens_total") - before == 4


def test_large_echo_bodies_are_refused_while_the_server_stays_live(cluster):
    """Four concurrent 3 MB completions bodies of token ids with echo (each past the context)
    are 400s, checked before their echo is decoded; /health/live answers within 1 s throughout."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps({"model": MODEL, "prompt": [1000] * 600_000, "echo": True, "max_tokens": 1}).encode()
    assert 3 << 20 <= len(body) < 4 << 20
    done = threading.Event()
    probes: list[float] = []

    def probe() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            assert httpx.get(cluster.url + "/health/live", timeout=1.0).status_code == 200
            probes.append(time.monotonic() - t0)
            time.sleep(0.02)

    def post(_: int) -> httpx.Response:
        return httpx.post(cluster.url + "/v1/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})

    with ThreadPoolExecutor(5) as pool:
        watcher = pool.submit(probe)
        try:
            responses = list(pool.map(post, range(4)))
        finally:
            done.set()
        watcher.result()  # a probe past 1 s raised there
    assert [r.status_code for r in responses] == [400] * 4
    assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in responses)
    assert probes and max(probes) < 1.0
