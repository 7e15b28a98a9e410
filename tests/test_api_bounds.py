"""Bounds on what a client sizes, checked before expensive work (issue 30): message, content-part
and tool-call counts, schema sizes, grammar compilation off the loop within a time limit and a
few threads, and the size of non-streamed responses with logprobs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from mooncake.api import structured
from mooncake.api.errors import APIError, install_error_handlers
from mooncake.api.schemas import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_SCHEMA_BYTES, MAX_TOOLS, ChatCompletionRequest,
                                  CompletionRequest, check_response_size)
from mooncake.api.structured import compile_grammar
from mooncake.config import FrontendConfig

from test_structured import request_grammar

USER = {"role": "user", "content": "hi"}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", **{"messages": [USER], **kw})


def big_schema(n_bytes: int) -> dict:
    """An object schema of about ``n_bytes`` serialized (many small properties)."""
    props = {f"p{i:05d}": {"type": "integer"} for i in range(n_bytes // 28 + 1)}
    return {"type": "object", "properties": props}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def http_error(body: dict) -> tuple[int, dict]:
    """The status and error body a chat request gets from the API's validation and error handlers."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/chat")
    async def _chat(_: ChatCompletionRequest) -> dict:
        return {}

    r = TestClient(app).post("/chat", json={"model": "m", **body})
    return r.status_code, r.json().get("error", {})


def test_message_count_is_bounded():
    chat(messages=[USER] * MAX_MESSAGES)
    status, err = http_error({"messages": [USER] * (MAX_MESSAGES + 1)})
    assert status == 400 and err["param"] == "messages" and str(MAX_MESSAGES) in err["message"]


def test_content_parts_and_tool_calls_per_message_are_bounded():
    parts = [{"type": "text", "text": "x"}]
    chat(messages=[{"role": "user", "content": parts * MAX_CONTENT_PARTS}])
    status, err = http_error({"messages": [{"role": "user", "content": parts * (MAX_CONTENT_PARTS + 1)}]})
    assert status == 400 and err["param"] == "messages.0.content" and "content parts" in err["message"]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValidationError):
        chat(messages=[USER, {"role": "assistant", "tool_calls": [call] * (MAX_TOOLS + 1)}])


def test_a_tool_parameters_schema_is_bounded():
    chat(tools=[tool("ok", big_schema(MAX_SCHEMA_BYTES - 100))])
    status, err = http_error({"messages": [USER], "tools": [tool("ok", {}), tool("big", big_schema(MAX_SCHEMA_BYTES))]})
    assert status == 400 and err["param"] == "tools.1.function.parameters" and "bytes" in err["message"]


def test_a_response_format_schema_is_bounded():
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": big_schema(MAX_SCHEMA_BYTES)}}
    status, err = http_error({"messages": [USER], "response_format": fmt})
    assert status == 400 and err["param"] == "response_format.json_schema.schema"


def test_the_schema_compiled_at_once_is_bounded():
    """tool_choice "required" compiles every tool's schema at once: each may be within bounds, not all."""
    n = structured.MAX_GRAMMAR_SCHEMA_BYTES // MAX_SCHEMA_BYTES + 1
    body = chat(tools=[tool(f"t{i}", big_schema(MAX_SCHEMA_BYTES - 100)) for i in range(n)], tool_choice="required")
    with pytest.raises(APIError) as e:
        request_grammar(body)
    assert e.value.status == 400 and e.value.param == "tools" and e.value.code == "schema_too_large"


async def test_grammars_compile_off_the_event_loop(monkeypatch):
    body = chat(response_format={"type": "json_object"})
    assert await compile_grammar(body) == request_grammar(body)
    threads = []

    def record(schema: dict, param: str) -> str:
        threads.append(threading.current_thread())
        return "g"

    monkeypatch.setattr(structured, "schema_grammar", record)
    assert await compile_grammar(body) == "g" and threads[0] is not threading.main_thread()
    assert await compile_grammar(chat()) == "" and len(threads) == 1  # free text: no thread at all


async def test_a_compilation_past_its_time_limit_is_a_400(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(structured, "schema_grammar", lambda schema, param: release.wait(5) and "g")
    t0 = time.monotonic()
    try:
        with pytest.raises(APIError) as e:
            await compile_grammar(chat(response_format={"type": "json_object"}), FrontendConfig(grammar_timeout_s=0.1))
        assert time.monotonic() - t0 < 2
        assert e.value.status == 400 and e.value.param == "response_format" and "too complex" in e.value.message
        assert await compile_grammar(chat()) == ""  # others are not held up meanwhile
    finally:
        release.set()  # the thread, left to finish in the background


async def test_compilations_run_a_few_at_once_and_waiting_is_not_timed(monkeypatch):
    running, most = 0, 0
    lock = threading.Lock()

    def slow(schema: dict, param: str) -> str:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.3)
        with lock:
            running -= 1
        return "g"

    limits = FrontendConfig(grammar_timeout_s=0.5)
    monkeypatch.setattr(structured, "schema_grammar", slow)
    body = chat(response_format={"type": "json_object"})
    n = 3 * structured.GRAMMAR_THREADS  # the last ones wait ~0.6 s for a thread: more than their time limit
    assert await asyncio.gather(*[compile_grammar(body, limits) for _ in range(n)]) == ["g"] * n
    assert most == structured.GRAMMAR_THREADS
    limits = FrontendConfig(grammar_timeout_s=0.5, grammar_queue_s=0.1)  # every thread held longer than a request may wait
    results = await asyncio.gather(*[compile_grammar(body, limits) for _ in range(n)], return_exceptions=True)
    refused = [r for r in results if isinstance(r, APIError)]
    assert refused and all(r.status == 503 and r.retry_after_s for r in refused) and "g" in results


def test_non_streamed_responses_with_many_logprobs_are_refused():
    lp = {"logprobs": True, "top_logprobs": 20}
    with pytest.raises(APIError) as e:
        check_response_size(chat(n=16, temperature=1, **lp), 4096)
    assert e.value.status == 400 and e.value.param == "n" and "stream" in e.value.message
    with pytest.raises(APIError) as e:
        check_response_size(CompletionRequest(model="m", prompt="p", logprobs=20, max_tokens=200_000), 200_000)
    assert e.value.status == 400 and e.value.param == "max_tokens"
    check_response_size(chat(n=16, temperature=1, stream=True, **lp), 4096)  # streamed: not bounded here
    check_response_size(chat(n=16, temperature=1), 32_768)  # no logprobs
    check_response_size(chat(**lp), 32_768)  # one choice over a 32k context
    check_response_size(chat(**lp), 200_000)  # one choice, no limit asked: what the context allows
    check_response_size(CompletionRequest(model="m", prompt="p", logprobs=5), 32_768)
