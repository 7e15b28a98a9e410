"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize``: ``{"model", "prompt", "add_special_tokens"?}`` or ``{"model", "messages",
"add_generation_prompt"?}`` -> ``{"count", "max_model_len", "tokens", "token_strs"}``;
``/detokenize``: ``{"model", "tokens"}`` -> ``{"prompt"}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mooncake.api.errors import APIError
from mooncake.api.schemas import ChatMessage

if TYPE_CHECKING:
    from mooncake.api.prompts import Prompts
    from mooncake.frontend import Frontend


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = Field(None, max_length=10_000_000)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=10_000_000)


def _check_model(frontend: "Frontend", model: str | None) -> None:
    if model is not None and model != frontend.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {frontend.model_name!r}",
                       param="model", code="model_not_found")


def add_token_routes(app: FastAPI, frontend: "Frontend", prompts: "Prompts") -> None:
    tokenizer: Any = frontend.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(frontend, body.model)
        if body.messages is not None:
            tokens = await prompts.chat(body.messages, None, body.add_generation_prompt)
        else:
            tokens = await prompts.encode(body.prompt or "", body.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": frontend.max_model_len, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(frontend, body.model)
        vocab = len(tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await prompts.decode(body.tokens)}
