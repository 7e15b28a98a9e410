"""Server-sent events in OpenAI's chunk format: a role chunk (chat), content chunks,
the finish chunk, optionally a usage chunk, then ``data: [DONE]``. A failure mid-stream
is an ``error`` event (OpenAI's error body) before ``[DONE]``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from mooncake.conductor import RequestError


@dataclass(frozen=True)
class Piece:
    """A piece of a request's output text; the last one has ``finish`` or ``error`` set."""

    text: str
    finish: str | None = None  # "stop" | "length"
    error: RequestError | None = None


def _event(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def sse_stream(pieces: AsyncIterator[Piece], rid: str, model: str, chat: bool,
                     usage: Callable[[], dict | None], error_body: Callable[[RequestError], dict]
                     ) -> AsyncIterator[bytes]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
        if chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice: dict = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return _event({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

    if chat:
        yield chunk("", None, first=True)
    async for piece in pieces:
        if piece.error is not None:
            yield _event(error_body(piece.error))
            break
        if piece.text or piece.finish:
            yield chunk(piece.text, piece.finish)
    body = usage()
    if body is not None:
        yield _event({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": body})
    yield b"data: [DONE]\n\n"
