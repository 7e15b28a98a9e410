"""Request bodies for one session's turns, carrying the conversation history.

Turn ``t`` of a session sends every earlier user turn and the answer the
server returned for it, then the new user tokens: as a chat message history
(``chat`` endpoint), as one concatenated text prompt (``completions`` + ``text``)
or as one token-id list (``completions`` + ``tokens``, answers re-encoded with
the given tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from mooncake.bench.prompts import ids_to_text
from mooncake.bench.workloads import Session

Endpoint = Literal["completions", "chat"]
PromptMode = Literal["tokens", "text"]
Encoder = Callable[[str], list[int]]


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares."""

    model: str
    endpoint: Endpoint = "completions"
    prompt_mode: PromptMode = "tokens"
    temperature: float = 0.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.endpoint == "chat" and self.prompt_mode == "tokens":
            raise ValueError("the chat endpoint takes text: use prompt mode 'text'")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


class Conversation:
    """History of one session; builds the body of each turn in order."""

    def __init__(self, session: Session, options: RequestOptions, encode: Encoder | None = None) -> None:
        self.session = session
        self.options = options
        self._encode = encode
        self._answers: list[str] = []

    @property
    def next_turn(self) -> int:
        return len(self._answers)

    def record_answer(self, text: str) -> None:
        """The completion text the server returned for the current turn."""
        self._answers.append(text)

    def prompt_token_count(self) -> int | None:
        """Tokens of the next prompt when known exactly without the server (tokens mode)."""
        if self.options.prompt_mode != "tokens":
            return None
        return len(self._token_prompt())

    def _token_prompt(self) -> list[int]:
        ids: list[int] = []
        for t in range(self.next_turn + 1):
            ids.extend(self.session.turns[t])
            if t < self.next_turn:
                if self._encode is None:
                    raise RuntimeError("multi-turn token prompts need a tokenizer to encode answers")
                ids.extend(self._encode(self._answers[t]))
        return ids

    def _text_prompt(self) -> str:
        text = ""
        for t in range(self.next_turn + 1):
            text += ("\n" if t else "") + ids_to_text(self.session.turns[t])
            if t < self.next_turn:
                text += self._answers[t]
        return text

    def _messages(self) -> list[dict[str, str]]:
        messages = []
        for t in range(self.next_turn + 1):
            messages.append({"role": "user", "content": ids_to_text(self.session.turns[t])})
            if t < self.next_turn:
                messages.append({"role": "assistant", "content": self._answers[t]})
        return messages

    def body(self) -> dict[str, Any]:
        """JSON body of the next turn's streaming request."""
        opts = self.options
        body: dict[str, Any] = {
            "model": opts.model,
            "max_tokens": self.session.max_tokens[self.next_turn],
            "temperature": opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if opts.ignore_eos:
            body["ignore_eos"] = True
        if opts.endpoint == "chat":
            body["messages"] = self._messages()
        elif opts.prompt_mode == "tokens":
            body["prompt"] = self._token_prompt()
        else:
            body["prompt"] = self._text_prompt()
        return body
