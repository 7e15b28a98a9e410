"""Grammars from response_format / tools, tool calls read back, keep-alives, merged choices."""

from __future__ import annotations

import asyncio
import json

import pytest

from mooncake.api.choices import merged
from mooncake.api.errors import APIError
from mooncake.api.schemas import ChatCompletionRequest
from mooncake.api.sse import KEEPALIVE, Piece, sse_stream
from mooncake.api.structured import grammar_schema, schema_grammar, tool_calls

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def request_grammar(body: ChatCompletionRequest) -> str:
    """The request's grammar compiled here, blocking ("" for free text)."""
    spec = grammar_schema(body)
    return "" if spec is None else schema_grammar(*spec)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_grammars_follow_the_request():
    assert request_grammar(chat()) == "" and request_grammar(chat(tools=[TOOL])) == ""  # auto: free text
    assert request_grammar(chat(tools=[TOOL], tool_choice="none")) == ""
    named = json.loads(request_grammar(chat(tools=[TOOL], tool_choice={"type": "function",
                                                                       "function": {"name": "add"}})))
    assert named["grammars"][0]["json_schema"]["required"] == ["a", "b"]
    required = json.loads(request_grammar(chat(tools=[TOOL], tool_choice="required")))
    assert required["grammars"][0]["json_schema"]["type"] == "array"
    fmt = json.loads(request_grammar(chat(response_format={"type": "json_object"})))
    assert fmt["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"] is False


def test_an_unusable_schema_is_a_400():
    with pytest.raises(APIError) as e:
        schema_grammar({"type": "wat"}, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format"


def test_tool_calls_read_back():
    body = chat(tools=[TOOL])
    content, calls = tool_calls("auto", 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                        '</tool_call>', body)
    assert content == "Sure." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert tool_calls("auto", "no call here", body) == ("no call here", [])
    assert tool_calls("auto", '<tool_call>{"name": "other", "arguments": {}}</tool_call>', body)[1] == []
    content, calls = tool_calls("required", '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', body)
    assert content is None and calls[0]["function"]["name"] == "add"
    assert tool_calls("required", '[{"name": "add", "argu', body) == ('[{"name": "add", "argu', [])


async def _slow(pieces: list[Piece], delay: float):
    for p in pieces:
        await asyncio.sleep(delay)
        yield p


async def test_merged_choices_and_keepalives():
    streams = [_slow([Piece("a"), Piece("b", "stop")], 0.05), _slow([Piece("c", "length")], 0.01)]
    out = [p async for p in merged(streams, keepalive_s=0.02)]
    got = [(p.index, p.text) for p in out if p is not None]
    assert sorted(got) == [(0, "a"), (0, "b"), (1, "c")] and None in out
    chunks = [c async for c in sse_stream(merged([_slow([Piece("x", "stop")], 0.05)], 0.01), "id", "m", True,
                                          lambda: None, lambda e: {})]
    assert KEEPALIVE in chunks and chunks[-1] == b"data: [DONE]\n\n"


async def test_chat_without_a_template_is_a_400():
    from mooncake.api.prompts import Prompts
    from mooncake.api.schemas import ChatMessage

    class NoTemplate:
        chat_template = None

    class Refusing:
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def apply_chat_template(self, *a, **kw):
            raise ValueError("roles must alternate")

    msgs = [ChatMessage(role="user", content="hi")]
    for tok, code in ((NoTemplate(), "no_chat_template"), (Refusing(), "chat_template_error")):
        prompts = Prompts(tok)
        with pytest.raises(APIError) as e:
            await prompts.chat(msgs)
        assert e.value.status == 400 and e.value.code == code and e.value.param == "messages"
        prompts.close()
