"""Prompts to token ids, off the event loop: templating and tokenizing a long prompt
takes milliseconds the API process's loop must spend on other requests' tokens.

Two lanes: work on up to ``SMALL_CHARS`` characters (a chat turn, ``/tokenize`` of a sentence, an
echo's decoding) has a thread of its own, so it never queues behind a client's
megabyte prompts; larger work shares ``large_threads`` threads (the Rust tokenizer releases the
GIL while it encodes, so they run on several cores at once).
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncake.api.text_codec import Codec
from mooncake.api.errors import APIError
from mooncake.api.schemas import ChatMessage
from mooncake.api.structured import tool_call_text, tools_system_text


def _turn(m: ChatMessage, template_renders_calls: bool) -> dict:
    turn: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        if template_renders_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                                  for c in m.tool_calls]
        else:
            calls = "\n".join(tool_call_text(c.function.name, c.function.arguments) for c in m.tool_calls)
            turn["content"] = (turn["content"] + "\n" + calls).strip()
    return turn


def _args(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


SMALL_CHARS = 16 << 10  # work on at most this many characters (or token ids) takes the small lane


def _large_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


class Prompts:
    def __init__(self, tokenizer: Any, codec: Codec | None = None, large_threads: int = 0) -> None:
        """``large_threads``: threads for large prompts (0: the cores this process may use, at most 4)."""
        self.tokenizer = tokenizer  # the chat template's
        self.codec = codec or Codec(tokenizer)  # text <-> ids
        self._small = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-small")
        self._large = ThreadPoolExecutor(large_threads or _large_threads(), thread_name_prefix="tokenizer")

    async def _run(self, size: int, fn: Any, *args: Any) -> Any:
        pool = self._small if size <= SMALL_CHARS else self._large
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return await self._run(len(prompt), self.codec.encode, prompt)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(len(text), self.codec.encode, text, add_special_tokens)

    async def decode(self, tokens: list[int]) -> str:
        return await self._run(len(tokens), self.codec.decode, tokens)

    async def chat(self, messages: list[ChatMessage], tools: list[dict] | None = None,
                   add_generation_prompt: bool = True) -> list[int]:
        """The conversation through the model's chat template (which gets ``tools``; one that
        does not render tools or tool calls gets them as Hermes-format text)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template or not isinstance(template, str):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        turns = [_turn(m, "tool_calls" in template) for m in messages]
        if tools and "tools" not in template:
            system = tools_system_text(tools)
            if turns[0]["role"] == "system":
                turns[0] = {**turns[0], "content": turns[0]["content"] + "\n\n" + system}
            else:
                turns.insert(0, {"role": "system", "content": system})
            tools = None
        size = sum(len(t["content"] or "") + len(json.dumps(t.get("tool_calls") or "")) for t in turns) \
            + len(json.dumps(tools) if tools else "")
        return await self._run(size, self._chat, turns, tools, add_generation_prompt)

    def _chat(self, turns: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as e:  # the template refused the conversation (jinja raise_exception, bad roles)
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                           code="chat_template_error") from None
        return self.codec.encode(text, add_special_tokens=False)

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
