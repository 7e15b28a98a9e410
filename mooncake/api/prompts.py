"""Prompts to token ids, off the event loop: templating and tokenizing a long prompt
takes milliseconds the conductor's loop must spend on other requests' tokens."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mooncake.api.errors import APIError
from mooncake.api.schemas import ChatMessage


class Prompts:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")  # one tokenizer, one thread

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return await self._run(self.tokenizer.encode, prompt)

    async def chat(self, messages: list[ChatMessage]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        return await self._run(self._chat, turns)

    def _chat(self, turns: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
