"""Calls to a running cluster's HTTP API and reading what comes back: completions (whole or
streamed), SSE events, Prometheus metrics."""

from __future__ import annotations

import json
import re
from typing import Callable, Iterable

import httpx

MODEL = "SmolLM2-135M-Instruct"


def sse_events(lines: Iterable[str]) -> list:
    """The events of an SSE body (its lines): parsed JSON objects, and "[DONE]"."""
    events: list = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream(url: str, body: dict, on_event: Callable[[int, object], bool | None] | None = None,
           path: str = "/v1/completions", headers: dict | None = None, timeout: float = 120) -> list:
    """POST a streaming request and parse its events as they come; ``on_event(n, event)`` is
    called after the n-th event (1-based) and stops reading when it returns True."""
    events: list = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.strip():
                continue
            events += sse_events([line])
            if on_event is not None and on_event(len(events), events[-1]):
                break
    return events


def stream_text(events: list) -> str:
    return "".join(e["choices"][0].get("text", "") or e["choices"][0].get("delta", {}).get("content", "") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def complete(url: str, prompt: object, max_tokens: int = 16, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)
