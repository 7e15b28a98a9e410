"""Request bodies of the OpenAI API, validated; options we do not support are named in a 400."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Union

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from mooncake.api.errors import APIError

# Accepted only at their no-op value; anything else is a 400 that names them.
_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "best_of": (1, None),
    "suffix": (None, ""),
}
MAX_N = 16
MAX_LOGPROBS = 20
# Bounds on what a client sizes, all far above what a real client sends (OpenAI's own: 2048 messages, 128 tools).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 1024  # per message
MAX_TOOLS = 128  # tools of a request, tool calls of an assistant message
MAX_SCHEMA_BYTES = 64 * 1024  # a tool's parameters or a response_format schema, serialized
MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # a non-streamed response with logprobs, estimated
# Token ids a client sends (prompt, stop_token_ids, logit_bias keys) are refused above this, here: larger
# ones overflow the tokenizer (u32) or the wire (msgpack, 64 bits) before the vocabulary check.
MAX_TOKEN_ID = 2**31 - 1
_IGNORED = {"metadata", "store"}  # harmless: accepted and ignored


def _valid_unicode(data: Any) -> Any:
    """``data`` (a parsed JSON body or part of one) if every string in it, keys included, is valid
    Unicode. Python's JSON parser lets a ``\\ud800`` escape (a lone UTF-16 surrogate) through, and
    pydantic passes it into plain ``str`` fields; no tokenizer or UTF-8 encoder takes it. Checked by
    encoding to UTF-8 in C (a 3 MB body of token ids: ~10 ms); only a body that fails is walked
    for the path to name."""
    try:
        msgspec.json.encode(data)
        return data
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError, OverflowError):  # an integer past 64 bits, or a caller's object
        try:
            json.dumps(data, ensure_ascii=False).encode()  # also C, also ~10x the walk's speed
            return data
        except UnicodeEncodeError:
            pass
        except (TypeError, ValueError):
            pass
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: a deeply nested body must not exhaust the stack
        where, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{where or 'body'}: text must be valid Unicode (a \\uXXXX escape of a "
                                     "lone surrogate is not)") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((where, k))
                stack.append((f"{where}.{k}" if where else str(k), v))
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}" if where else str(i), v) for i, v in enumerate(value))
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    # JSON bytes of one logprob entry (the chosen token's or one of its top ones) in a response
    logprob_entry_bytes: ClassVar[int] = 72

    model: str
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1_000_000)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: keep generating past eos (benchmarks)
    cache_salt: str | None = Field(None, max_length=256)  # extension: tenant isolation of the KV cache
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)  # extension (vLLM)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension (vLLM)
    min_tokens: int = Field(0, ge=0, le=1_000_000)  # extension (vLLM)
    speculative: StrictBool = True  # extension: false never decodes this request speculatively
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64)  # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None  # the request's class
    priority: StrictInt = Field(0, ge=-(2**31), le=2**31 - 1)  # extension (vLLM): within a class, lower first
    # the session a request is a turn of (extension; or user, with [classes] session_from_user): its prefix is kept
    session_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    user: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return _valid_unicode(data)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[int, float]:
        out: dict[int, float] = {}
        for k, b in (v or {}).items():
            if not k.isdigit() or len(k) > len(str(MAX_TOKEN_ID)) or int(k) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (at most {MAX_TOKEN_ID}), got {k[:32]!r}")
            if not -100 <= b <= 100:
                raise ValueError("values must be in [-100, 100]")
            out[int(k)] = b
        if len(out) > 1024:
            raise ValueError("at most 1024 entries")
        return out

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int]:
        if any(not 0 <= t <= MAX_TOKEN_ID for t in v or []):
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
        return list(v or [])

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not isinstance(s, str) or not s or len(s) > 256 for s in stops):
            raise ValueError("stop sequences must be non-empty strings of at most 256 characters")
        return stops

    def check_supported(self) -> None:
        """400 naming every option that is unknown or set to a value we do not support."""
        extra = dict(self.model_extra or {})
        bad = [k for k, v in extra.items()
               if k not in _IGNORED and (k not in _ONLY_DEFAULT or v not in _ONLY_DEFAULT[k])]
        if bad:
            raise APIError(400, "unsupported parameter(s): " + ", ".join(sorted(bad)), param=sorted(bad)[0],
                           code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        limit = self.limit()
        if limit is not None and self.min_tokens > limit:
            raise APIError(400, f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({limit})",
                           param="min_tokens")
        if self.n > 1 and self.temperature == 0:
            raise APIError(400, "n > 1 needs temperature > 0 (greedy choices would all be the same)", param="n")

    def limit(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int:
        """-1: none; k >= 0: the chosen token's logprob and the k most likely."""
        return -1


class CompletionRequest(_Sampling):
    logprob_entry_bytes: ClassVar[int] = 32
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]  # strict: true is no token id
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprobs_wanted(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, list) and p and (min(p) < 0 or max(p) > MAX_TOKEN_ID):  # (C loops: a token-id prompt
            # may be megabytes) before the echo's decoding, which overflows on ids past 2**32
            raise APIError(400, f"prompt token ids must be integers in [0, {MAX_TOKEN_ID}]", param="prompt")
        return p


def _bounded_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` if it is at most ``MAX_SCHEMA_BYTES`` serialized (compactly)."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"the JSON schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
    return schema


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant
    tool_call_id: str | None = None  # tool

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:  # a message also comes alone, in /tokenize
        return _valid_unicode(data)

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:  # before the parts are validated
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts per message")
        return v

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded_schema(v)


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _bounded_schema(v)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.response_format and self.response_format.type == "json_schema" and not self.response_format.json_schema:
            raise APIError(400, "response_format json_schema needs a json_schema object", param="response_format")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools or []}:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        constrained_tools = choice == "required" or isinstance(choice, NamedToolChoice)
        if constrained_tools and self.response_format and self.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a required or named tool_choice",
                           param="response_format")

    def tool_mode(self) -> str:
        """"none" | "auto" | "required" | "named" (tools given without tool_choice: auto)."""
        if not self.tools:
            return "none"
        choice = self.tool_choice or "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice


def check_response_size(body: _Sampling, max_tokens: int) -> None:
    """400 if a non-streamed response with logprobs could be larger than ``MAX_RESPONSE_BYTES``:
    n x max_tokens x (1 + top logprobs) entries of ``logprob_entry_bytes``, all held in memory
    before the first byte is sent. ``max_tokens``: the most tokens a choice can generate (the
    request's, clamped to what the context leaves). Streamed responses are not bounded here."""
    top = body.logprobs_wanted()
    if body.stream or top < 0 or (body.n == 1 and body.limit() is None):
        return  # one choice with no limit asked: what the context allows, as a client expects
    estimate = body.n * max_tokens * (1 + top) * body.logprob_entry_bytes
    if estimate > MAX_RESPONSE_BYTES:
        mib = 1024 * 1024
        raise APIError(400, f"a response with n={body.n}, up to {max_tokens} tokens per choice and {top} top "
                            f"logprobs per token could be ~{estimate // mib} MiB, above the "
                            f"{MAX_RESPONSE_BYTES // mib} MiB a non-streamed response may have: stream it "
                            "(\"stream\": true) or ask for fewer tokens (max_tokens), choices (n) or top logprobs",
                       param="n" if body.n > 1 else "max_tokens", code="response_too_large")
