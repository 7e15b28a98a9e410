"""Where a profiled conductor's event-loop time goes: cProfile's own time grouped by component.

A function's component comes from its file path or, for built-ins, its description (first
matching rule wins). Time spent waiting in the event loop's ``epoll`` is idle, not work: it
is left out of the shares.
"""

from __future__ import annotations

import pstats
from pathlib import Path

IDLE = "idle (epoll wait)"
RULES: list[tuple[str, tuple[str, ...]]] = [
    (IDLE, ("select.epoll",)),
    ("detokenize (text out)", ("mooncake/api/text_stream",)),
    ("tokenizer", ("tokeniz",)),
    ("block hashing", ("mooncake/blocks", "hashlib", "sha256", "xxh")),
    ("scheduler + KV index", ("mooncake/sched/",)),
    ("conductor (request life)", ("mooncake/conductor/",)),
    ("ZeroMQ + wire protocol", ("zmq", "mooncake/sockets", "mooncake/protocol", "msgspec")),
    ("HTTP server (uvicorn, h11/httptools)", ("uvicorn", "h11", "httptools")),
    ("FastAPI + starlette + pydantic", ("starlette", "fastapi", "pydantic")),
    ("API routes + SSE", ("mooncake/api/",)),
    ("metrics", ("prometheus", "mooncake/metrics")),
    ("json", ("json",)),
    ("asyncio event loop", ("asyncio",)),
]


def component(label: str) -> str:
    """The component of a function described by ``label`` (``file:line(name)``)."""
    low = label.lower()
    for name, needles in RULES:
        if any(n in low for n in needles):
            return name
    return "other"


def _label(key: tuple[str, int, str]) -> str:
    file, line, func = key
    return func if file == "~" else f"{file}:{line}({func})"


def components(path: Path) -> list[tuple[str, float]]:
    """(component, share of the non-idle own time), largest first."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    totals: dict[str, float] = {}
    for key, (_, _, tt, _, _) in stats.items():
        name = component(_label(key))
        totals[name] = totals.get(name, 0.0) + tt
    totals.pop(IDLE, None)
    busy = sum(totals.values()) or 1.0
    return sorted(((k, v / busy) for k, v in totals.items()), key=lambda kv: -kv[1])


def top_functions(path: Path, n: int) -> list[tuple[str, float, int]]:
    """The ``n`` functions with the most own time (idle left out): (label, seconds, calls)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    rows = [(_label(k), tt, nc) for k, (_, nc, tt, _, _) in stats.items() if component(_label(k)) != IDLE]
    rows.sort(key=lambda r: -r[1])
    return [(label.split("site-packages/")[-1].replace("|", "/"), tt, nc) for label, tt, nc in rows[:n]]
