"""Structured output and tools: what a chat request's ``response_format`` / ``tools`` /
``tool_choice`` make of the decoding grammar, and the tool calls read back from the output.

Grammars are llguidance JSON-schema grammars with fixed separators (``", "`` and ``": "``)
and no free whitespace between JSON tokens, so a small model cannot loop on blanks.
Tool calls use the Hermes format (Qwen2/3, SmolLM, Hermes): ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``; a chat template that does not render ``tools`` or
``tool_calls`` itself gets them in that format in the conversation.

Grammars are compiled off the event loop (``compile_grammar``), by at most ``GRAMMAR_THREADS``
at once and within ``[frontend] grammar_timeout_s``; llguidance's own parser limits (``LLParserLimits``
defaults: grammar size, lexer fuel and states) make most oversized schemas fail fast.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncake.api.errors import APIError
from mooncake.api.schemas import MAX_SCHEMA_BYTES, ChatCompletionRequest, NamedToolChoice
from mooncake.config import FrontendConfig

GRAMMAR_THREADS = 2  # compilations at once; a grammar past its time limit keeps its thread until it is done
MAX_GRAMMAR_SCHEMA_BYTES = 4 * MAX_SCHEMA_BYTES  # compiled at once (tool_choice "required": every tool's)

_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_compiler = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")


def schema_grammar(schema: dict[str, Any], param: str) -> str:
    """An llguidance grammar for JSON matching ``schema``; 400 naming ``param`` if it is not usable."""
    import llguidance
    text = json.dumps(schema)
    if len(text) > MAX_GRAMMAR_SCHEMA_BYTES:
        raise APIError(400, f"the JSON schema to compile is {len(text)} bytes; at most {MAX_GRAMMAR_SCHEMA_BYTES} "
                            "are accepted", param=param, code="schema_too_large")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=_SEPARATORS)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"invalid JSON schema: {e}", param=param, code="invalid_schema") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"unsupported JSON schema: {error}", param=param, code="invalid_schema")
    return grammar


def _call_schema(tool: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                            "arguments": tool.function.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def grammar_schema(body: ChatCompletionRequest) -> tuple[dict[str, Any], str] | None:
    """The JSON schema the request's output must match and the param it comes from (None: free text)."""
    mode = body.tool_mode()
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        tool = next(t for t in body.tools or [] if t.function.name == body.tool_choice.function.name)
        return tool.function.parameters, "tools"
    if mode == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in body.tools or []]}}
        if body.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return calls, "tools"
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}, "response_format"
    assert fmt.json_schema is not None
    return fmt.json_schema.schema_ or {"type": "object"}, "response_format"


async def compile_grammar(body: ChatCompletionRequest, limits: FrontendConfig = FrontendConfig()) -> str:
    """The request's grammar, compiled in a grammar thread: a request waits for a free one (up to
    ``limits.grammar_queue_s``: then a 503), then has ``limits.grammar_timeout_s`` (past it: a 400,
    the compilation finishing in the background)."""
    spec = grammar_schema(body)
    if spec is None:  # free text: no thread, no wait behind others' schemas
        return ""
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def run() -> str:
        loop.call_soon_threadsafe(started.set)
        return schema_grammar(*spec)

    job = _compiler.submit(run)
    try:
        try:
            await asyncio.wait_for(started.wait(), limits.grammar_queue_s)
        except TimeoutError:
            raise APIError(503, "busy compiling other requests' JSON schemas; try again", code="overloaded",
                           retry_after_s=1) from None
        return await asyncio.wait_for(asyncio.wrap_future(job), limits.grammar_timeout_s)
    except TimeoutError:
        raise APIError(400, f"JSON schema too complex to compile in time ({limits.grammar_timeout_s:g} s)", param=spec[1],
                       code="invalid_schema") from None
    finally:
        job.cancel()  # still queued (the client went away): never runs; running or done: no effect


def tools_for_template(body: ChatCompletionRequest) -> list[dict] | None:
    """``tools`` as chat templates expect them (None: none, or tool_choice "none")."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def tools_system_text(tools: list[dict]) -> str:
    """Hermes-style tool instructions, for templates that do not render ``tools`` themselves."""
    lines = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions are:\n<tools>\n"
            f"{lines}\n</tools>\nFor each function call, return a JSON object with the function name and "
            'arguments within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call>')


def tool_call_text(name: str, arguments: str) -> str:
    """An earlier assistant tool call, in the Hermes format."""
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def tool_calls(mode: str, text: str, body: ChatCompletionRequest) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an output under the request's tool mode."""
    if mode == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        return None, [_call(body.tool_choice.function.name, text)]
    if mode == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["arguments"]) for c in calls]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []  # cut short (length): the text as it is
    if mode == "auto":
        names = {t.function.name for t in body.tools or []}
        calls = []
        for m in _TOOL_CALL.finditer(text):
            try:
                c = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if isinstance(c, dict) and c.get("name") in names:
                calls.append(_call(c["name"], c.get("arguments", {})))
        if calls:
            rest = _TOOL_CALL.sub("", text).strip()
            return rest or None, calls
    return text, []
