"""The choices of a completion: their outputs merged into one event stream (``n`` > 1,
keep-alive ticks while nothing comes), their logprobs in OpenAI's two shapes (chat and
completions), and the choice objects of a non-streaming response."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from mooncake import protocol as P
from mooncake.api.sse import Piece


async def merged(streams: list[AsyncIterator[Piece]], keepalive_s: float) -> AsyncIterator[Piece | None]:
    """Pieces of every choice (``piece.index`` says whose) as they come; None after each
    ``keepalive_s`` without any. Closing it cancels every choice's stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece.at(i))
        except Exception as e:  # handed to the consumer, raised there
            await queue.put(e)
            return
        await queue.put(i)  # this choice is done

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(keepalive_s):  # (no task per wait, as wait_for makes)
                        item = await queue.get()
                except TimeoutError:
                    yield None
                    continue
            if isinstance(item, Exception):
                raise item
            if isinstance(item, int):
                live -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class TokenText:
    """Token ids to the strings logprobs show (each token decoded alone), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.tokenizer.decode([token])
        return s


def chat_logprobs(entries: list[tuple[int, P.Logprob]], text_of: Callable[[int], str]) -> dict:
    def one(token: int, lp: float) -> dict:
        s = text_of(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**one(t, e.logprob), "top_logprobs": [one(i, v) for i, v in zip(e.top_ids, e.top_logprobs)]}
                        for t, e in entries]}


def completion_logprobs(entries: list[tuple[int, P.Logprob]], text_of: Callable[[int], str], offset: int) -> dict:
    tokens = [text_of(t) for t, _ in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e.logprob for _, e in entries],
            "top_logprobs": [{text_of(i): v for i, v in zip(e.top_ids, e.top_logprobs)} for _, e in entries],
            "text_offset": offsets}


@dataclass
class ChoiceOutput:
    """What one choice produced, collected for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, P.Logprob]] = field(default_factory=list)
    finish: str | None = None

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.logprobs.extend(piece.logprobs)
        if piece.finish:
            self.finish = piece.finish
