"""Server-sent events in OpenAI's chunk format: a role chunk per choice (chat), content
chunks (with their logprobs when asked), each choice's finish chunk, optionally a usage
chunk, then ``data: [DONE]``. A failure mid-stream is an ``error`` event (OpenAI's error
body) before ``[DONE]``. While nothing comes (queued, prefilling) a comment line keeps
proxies with idle timeouts from cutting the stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from mooncake.frontend.request import RequestError

KEEPALIVE = b": keep-alive\n\n"
log = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """An event stream whose every write must be taken by the client within ``write_timeout_s``
    (the kernel's and the server's buffers full: the client stopped reading). Past it the stream
    ends, which ends its requests everywhere (their KV freed), and uvicorn gives the connection up
    (the kernel keeps the socket until its buffer drains or TCP gives up): what a client that never
    reads makes the server hold is what arrived in that time, not the whole output."""

    def __init__(self, content: AsyncIterator[bytes], write_timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        stalled = False

        async def timed(message: Message) -> None:
            nonlocal stalled
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                stalled = True
                raise

        try:
            await super().stream_response(timed)
        except TimeoutError:
            if not stalled:  # from the events themselves: not the client's doing
                raise
            log.warning("a client took no event stream data for %.0f s: its request is cancelled",
                        self.write_timeout_s)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Piece:
    """A piece of a choice's output text; the last one has ``finish`` or ``error`` set.
    ``logprobs``: (token, Logprob) of the tokens that came with it, when asked for."""

    text: str
    finish: str | None = None  # "stop" | "length"
    error: RequestError | None = None
    logprobs: tuple = ()
    index: int = 0  # the choice

    def at(self, index: int) -> "Piece":
        return dataclasses.replace(self, index=index)


@dataclass
class StreamFormat:
    """How a stream's chunks are shaped beyond text."""

    n: int = 1
    logprobs: Callable[[Piece, int], dict] | None = None  # (piece, text offset so far) -> logprobs body
    tools: Callable[[str], tuple[str | None, list[dict]]] | None = None  # chat: text -> (content, tool_calls)
    echo: str = ""  # completions: the prompt, before each choice's text
    calls_finish: bool = True  # tool calls end with finish_reason "tool_calls" (not for a named tool_choice)
    request_class: str = ""  # the class the request is served in: every chunk's ``service_tier``


def _event(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def sse_stream(pieces: AsyncIterator[Piece | None], rid: str, model: str, chat: bool,
                     usage: Callable[[], dict | None], error_body: Callable[[RequestError], dict],
                     fmt: StreamFormat | None = None) -> AsyncIterator[bytes]:
    fmt = fmt or StreamFormat()
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": model}
    if fmt.request_class:
        head["service_tier"] = fmt.request_class

    def chunk(i: int, text: str | None, finish: str | None, logprobs: dict | None = None,
              delta: dict | None = None) -> bytes:
        if chat:
            delta = dict(delta or {})
            if text:
                delta["content"] = text
            choice: dict = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        return _event({**head, "choices": [choice]})

    try:
        async for event in _events(pieces, fmt, chat, chunk, error_body):
            yield event
    finally:  # however the stream ends: its requests end at once, not when the generator is collected
        await pieces.aclose()  # type: ignore[attr-defined]
    body = usage()
    if body is not None:
        yield _event({**head, "choices": [], "usage": body})
    yield b"data: [DONE]\n\n"


async def _events(pieces: AsyncIterator[Piece | None], fmt: StreamFormat, chat: bool, chunk: Callable[..., bytes],
                  error_body: Callable[[RequestError], dict]) -> AsyncIterator[bytes]:
    offsets = [0] * fmt.n
    held = [""] * fmt.n  # chat with tools: the text, until the choice ends
    for i in range(fmt.n):
        if chat:
            yield chunk(i, "", None, delta={"role": "assistant"})
        elif fmt.echo:
            yield chunk(i, fmt.echo, None)
    async for piece in pieces:
        if piece is None:
            yield KEEPALIVE
            continue
        if piece.error is not None:
            yield _event(error_body(piece.error))
            break
        i = piece.index
        lp = fmt.logprobs(piece, offsets[i] + len(fmt.echo)) if fmt.logprobs and piece.logprobs else None
        offsets[i] += len(piece.text)
        if fmt.tools is not None:
            held[i] += piece.text
            if piece.finish:
                content, calls = fmt.tools(held[i])
                delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]} if calls else {}
                yield chunk(i, content, "tool_calls" if calls and fmt.calls_finish and piece.finish == "stop" else piece.finish,
                            lp, delta)
            elif lp:
                yield chunk(i, None, None, lp)
            continue
        if piece.text or piece.finish or lp:
            yield chunk(i, piece.text, piece.finish, lp)
