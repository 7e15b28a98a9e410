"""Prompts to token ids, off the event loop: templating and tokenizing a long prompt
takes milliseconds the conductor's loop must spend on other requests' tokens."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncake.api.codec import Codec
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


class Prompts:
    def __init__(self, tokenizer: Any, codec: Codec | None = None) -> None:
        self.tokenizer = tokenizer  # the chat template's
        self.codec = codec or Codec(tokenizer)  # text <-> ids
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")  # one tokenizer, one thread

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return await self._run(self.codec.encode, prompt)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self.codec.encode, text, add_special_tokens)

    async def decode(self, tokens: list[int]) -> str:
        return await self._run(self.codec.decode, tokens)

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
        return await self._run(self._chat, turns, tools, add_generation_prompt)

    def _chat(self, turns: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(turns, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as e:  # the template refused the conversation (jinja raise_exception, bad roles)
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages",
                           code="chat_template_error") from None
        return self.codec.encode(text, add_special_tokens=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
