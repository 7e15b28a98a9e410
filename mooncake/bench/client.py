"""One streaming (SSE) OpenAI request -> one :class:`RequestRecord`.

Never raises for a failed request: HTTP errors, in-stream error objects,
transport errors and malformed chunks all end up in the record.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx


@dataclass
class RequestRecord:
    """Timings (seconds) and token counts of one request."""

    request_id: int
    session_id: str
    turn: int
    start_s: float
    """Send time, offset from the benchmark start."""
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    output_chars: int = 0

    @property
    def rejected(self) -> bool:
        """Rejected by admission control (HTTP 429)."""
        return self.status == 429

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (completion_tokens - 1); None with fewer than 2 tokens."""
        if (not self.ok or self.ttft_s is None or self.e2e_s is None
                or self.completion_tokens is None or self.completion_tokens < 2):
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _error_message(payload: bytes) -> str:
    """The OpenAI error body's message, else the (truncated) raw body."""
    text = payload.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text[:500] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
    return text[:500]


def _chunk_text(obj: dict[str, Any]) -> str:
    """Content of a completions (``text``) or chat (``delta.content``) chunk."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _apply_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.usage_reported = True
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens")


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                         record: RequestRecord, headers: dict[str, str] | None = None) -> str:
    """Send ``body`` to ``path`` with ``stream: true``, fill ``record``; return the output text."""
    pieces: list[str] = []
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                record.error = _error_message(await resp.aread())
                return ""
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"malformed SSE chunk: {data[:200]}"
                    return "".join(pieces)
                if "error" in obj:
                    err = obj["error"]
                    record.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return "".join(pieces)
                text = _chunk_text(obj)
                if text:
                    now = time.perf_counter()
                    if last is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    pieces.append(text)
                if obj.get("usage"):
                    _apply_usage(record, obj["usage"])
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return "".join(pieces)
    record.e2e_s = time.perf_counter() - start
    record.ok = True
    if record.completion_tokens is None:
        record.completion_tokens = chunks  # server sent no usage: one token per chunk
    record.output_chars = sum(len(p) for p in pieces)
    return "".join(pieces)
