"""Request bodies of the OpenAI API, validated; options we do not support are named in a 400."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mooncake.api.errors import APIError

# Accepted only at their no-op value; anything else is a 400 that names them.
_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "echo": (False, None),
    "logprobs": (False, None, 0),
    "top_logprobs": (0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None,),
}
_IGNORED = {"user", "metadata", "store", "service_tier"}  # harmless: accepted and ignored


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

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


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
        if isinstance(p, list) and any(isinstance(t, bool) or t < 0 for t in p):
            raise APIError(400, "prompt token ids must be non-negative integers", param="prompt")
        return p


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
