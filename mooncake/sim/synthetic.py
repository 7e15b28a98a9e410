"""Synthetic chat-like traces in the Mooncake format, and trace concatenation.

A chat trace: conversations arrive as a Poisson process; each starts from one of
a few shared system prompts (popularity Zipf-like) and runs several turns, each
turn's prompt being the whole history (system prompt, earlier questions and
answers) plus a new question, after a think time. Block ids are prefix-chained
as the format requires: a full block keeps its id across the turns of a
conversation, system-prompt blocks are shared by every conversation of their
prompt, and everything else is new.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from mooncake.bench.trace import TRACE_BLOCK_TOKENS, TraceRecord

B = TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class ChatTraceSpec:
    conversations: int = 400
    rate_per_s: float = 1.0  # conversation starts per second
    system_prompts: int = 8
    system_tokens: int = 4096  # mean length of a system prompt
    turns_mean: float = 3.0
    question_tokens: int = 600  # mean of a new user message (lognormal)
    answer_tokens: int = 300  # mean output length (lognormal)
    think_s: float = 30.0  # mean gap between an answer and the next question
    seed: int = 0


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.8) -> int:
    return max(1, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def chat_trace(spec: ChatTraceSpec) -> list[TraceRecord]:
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh() -> int:
        nonlocal next_id
        next_id += 1
        return next_id - 1

    systems = []
    for _ in range(spec.system_prompts):
        n = _lognormal(rng, spec.system_tokens, 0.5)
        systems.append((n, [fresh() for _ in range(n // B)]))
    weights = [1 / (k + 1) for k in range(spec.system_prompts)]
    rows: list[tuple[float, int, int, tuple[int, ...]]] = []
    t = 0.0
    for _ in range(spec.conversations):
        t += rng.expovariate(spec.rate_per_s)
        sys_len, sys_ids = rng.choices(systems, weights)[0]
        history = sys_len
        full_ids: list[int] = []  # ids of the conversation's full blocks so far
        at = t
        for _turn in range(max(1, round(rng.expovariate(1 / spec.turns_mean)) + 1)):
            prompt = history + _lognormal(rng, spec.question_tokens)
            out = _lognormal(rng, spec.answer_tokens)
            n_full = prompt // B
            for i in range(len(full_ids), n_full):
                full_ids.append(sys_ids[i] if i < len(sys_ids) else fresh())
            ids = full_ids[:n_full] + ([fresh()] if prompt % B else [])
            rows.append((at, prompt, out, tuple(ids)))
            history = prompt + out
            at += rng.expovariate(1 / spec.think_s) + out * 0.03
    rows.sort(key=lambda r: r[0])
    return [TraceRecord(i + 1, round(ts * 1000.0, 3), n, out, ids) for i, (ts, n, out, ids) in enumerate(rows)]


def concatenate(records: list[TraceRecord], copies: int, gap_ms: float = 1000.0) -> list[TraceRecord]:
    """``copies`` back-to-back replays of a trace, each with its own block ids (a copy shares
    nothing with another: the reuse structure of the original, repeated)."""
    span = max(r.timestamp_ms for r in records) - min(r.timestamp_ms for r in records) + gap_ms
    id_span = max(max(r.hash_ids) for r in records) + 1
    out = []
    for c in range(copies):
        for r in records:
            out.append(TraceRecord(len(out) + 1, r.timestamp_ms + c * span, r.input_length, r.output_length,
                                   tuple(h + c * id_span for h in r.hash_ids)))
    return out


def write_trace(records: list[TraceRecord], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
