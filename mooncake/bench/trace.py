"""Mooncake-format traces: reading, validating, scaling, hash-id expansion.

A trace is JSON Lines; each object has ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (ids of ``trace_block`` = 512-token blocks,
prefix-chained: equal leading ids mean an equal prefix). Every block but the
last is full, so ``(len(hash_ids) - 1) * 512 < input_length <= len(hash_ids) * 512``.

Scaling keeps the reuse structure: each hash id expands to ``block_tokens``
token ids that depend on the id only, the partial last block scales
proportionally, so two requests sharing ``k`` leading ids share exactly
``k * block_tokens`` leading tokens.

``min_span_s`` turns a short selection into a sustained one: the selected requests
are repeated, repetition after repetition at the selection's own mean rate, each
repetition on hash ids of its own (every id offset by ``r * (max id + 1)``), so a
repetition shares within itself exactly what the selection shares, and nothing with
another repetition (no cache a repetition filled can serve the next one).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from mooncake.bench.prompts import TokenRange, block_token_ids
from mooncake.bench.workloads import Session

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that does not follow the Mooncake format; names the line."""

    def __init__(self, path: str, line_no: int, message: str) -> None:
        super().__init__(f"{path}:{line_no}: {message}")
        self.path = path
        self.line_no = line_no


@dataclass(frozen=True)
class TraceRecord:
    """One validated trace line."""

    line_no: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    request_class: str = ""  # an optional ``service_tier`` field (an extension of the format): its request class


@dataclass(frozen=True)
class TraceScaling:
    """How to shrink a trace to a small machine while keeping its reuse structure."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    """Tokens each hash block expands to (512 keeps the trace's real lengths)."""
    time_scale: float = 1.0
    """Multiplies timestamps: 0.5 replays twice as fast."""
    max_input_tokens: int | None = None
    """Prompts longer than this (after block scaling) are truncated."""
    max_output_tokens: int | None = None
    """Caps each request's max_tokens."""
    max_requests: int | None = None
    """Keep only the first N requests."""
    duration_s: float | None = None
    """Keep only requests whose scaled arrival is within this many seconds."""
    prefix_groups: int | None = None
    """Keep only the requests of the N largest prefix groups (same first hash id), at their
    own times: a short replay that keeps the trace's long-range sharing, which a time
    slice of a few minutes mostly loses."""
    salt: int = 0
    """Non-zero: other tokens for every block (same reuse structure), so that repeated
    runs against one server do not hit each other's cached prefixes."""
    min_span_s: float | None = None
    """Repeat the selected requests (each repetition on hash ids of its own, arrivals at
    the selection's mean rate) until the scaled arrivals span at least this many seconds."""
    unique_prefixes: bool = False
    """Every request on hash ids of its own: the same lengths and arrivals, no block shared
    between requests (the trace with its reuse taken out)."""

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")
        for name in ("max_input_tokens", "max_output_tokens", "max_requests", "prefix_groups"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if self.min_span_s is not None and not self.min_span_s > 0:
            raise ValueError("min_span_s must be > 0")


def _int_field(obj: dict, key: str, path: str, line_no: int) -> int:
    if key not in obj:
        raise TraceError(path, line_no, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line_no, f"{key!r} must be an integer, got {value!r}")
    if value < 0:
        raise TraceError(path, line_no, f"{key!r} must be >= 0, got {value}")
    return value


def parse_trace_line(text: str, path: str, line_no: int) -> TraceRecord:
    """Validate one JSON line; raise :class:`TraceError` naming the line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(path, line_no, f"invalid JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line_no, "expected a JSON object")
    if "timestamp" not in obj:
        raise TraceError(path, line_no, "missing field 'timestamp'")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(path, line_no, f"'timestamp' must be a number >= 0, got {ts!r}")
    input_length = _int_field(obj, "input_length", path, line_no)
    output_length = _int_field(obj, "output_length", path, line_no)
    if "hash_ids" not in obj:
        raise TraceError(path, line_no, "missing field 'hash_ids'")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise TraceError(path, line_no, "'hash_ids' must be a list of integers")
    for h in hash_ids:
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceError(path, line_no, f"'hash_ids' must hold integers >= 0, got {h!r}")
    n = len(hash_ids)
    if n == 0:
        raise TraceError(path, line_no, "'hash_ids' is empty (a request needs at least one block)")
    if not (n - 1) * TRACE_BLOCK_TOKENS < input_length <= n * TRACE_BLOCK_TOKENS:
        raise TraceError(
            path, line_no,
            f"input_length {input_length} is inconsistent with {n} hash_ids "
            f"(expected {max(0, (n - 1) * TRACE_BLOCK_TOKENS) + 1}..{n * TRACE_BLOCK_TOKENS})")
    request_class = obj.get("service_tier", "")
    if request_class not in ("", "default", "priority", "flex"):
        raise TraceError(path, line_no, f"'service_tier' must be default, priority or flex, got {request_class!r}")
    return TraceRecord(line_no, float(ts), input_length, output_length, tuple(hash_ids), request_class)


def load_trace(path: str | Path) -> list[TraceRecord]:
    """Read and validate a whole trace file (blank lines are skipped)."""
    records = []
    name = str(path)
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                records.append(parse_trace_line(line, name, line_no))
    if not records:
        raise TraceError(name, 0, "trace is empty")
    return records


def scaled_input_length(record: TraceRecord, block_tokens: int) -> int:
    """Prompt length after scaling: full blocks scale exactly, the last one proportionally."""
    n = len(record.hash_ids)
    last = record.input_length - (n - 1) * TRACE_BLOCK_TOKENS
    last_scaled = max(1, min(block_tokens, round(last * block_tokens / TRACE_BLOCK_TOKENS)))
    return (n - 1) * block_tokens + last_scaled


def expand_prompt(record: TraceRecord, block_tokens: int, token_range: TokenRange,
                  cache: dict[int, list[int]] | None = None, salt: int = 0) -> list[int]:
    """The token ids of a trace request: one deterministic block per hash id.

    ``cache`` (hash id -> block tokens) saves regenerating blocks shared by
    many requests; the result does not depend on it.
    """
    length = scaled_input_length(record, block_tokens)
    tokens: list[int] = []
    for h in record.hash_ids:
        block = cache.get(h) if cache is not None else None
        if block is None:
            block = block_token_ids(h, block_tokens, token_range, salt)
            if cache is not None:
                cache[h] = block
        tokens.extend(block)
    return tokens[:length]


def _select(records: list[TraceRecord], scaling: TraceScaling) -> list[tuple[TraceRecord, float]]:
    """The requests a scaling keeps, in arrival order, with their scaled arrival offsets (s)."""
    if scaling.prefix_groups is not None:
        sizes = Counter(r.hash_ids[0] for r in records if r.hash_ids)
        keep = {h for h, _ in sizes.most_common(scaling.prefix_groups)}
        records = [r for r in records if r.hash_ids and r.hash_ids[0] in keep]
    if not records:
        return []
    t0 = min(r.timestamp_ms for r in records)
    chosen = []
    for i, rec in enumerate(sorted(records, key=lambda r: (r.timestamp_ms, r.line_no))):
        if scaling.max_requests is not None and i >= scaling.max_requests:
            break
        arrival = (rec.timestamp_ms - t0) / 1000.0 * scaling.time_scale
        if scaling.duration_s is not None and arrival > scaling.duration_s:
            break
        chosen.append((rec, arrival))
    return chosen


def repetitions(arrivals: list[float], min_span_s: float | None) -> tuple[int, float]:
    """How many repetitions of ``arrivals`` (sorted offsets, s) span at least ``min_span_s``,
    and the period between repetitions: the span plus one mean gap, so that the repeated
    arrivals keep the selection's mean rate, ``(n - 1) / span``."""
    if min_span_s is None or not arrivals:
        return 1, 0.0
    n, span = len(arrivals), arrivals[-1] - arrivals[0]
    if span >= min_span_s:
        return 1, 0.0
    if n < 2 or span <= 0:
        raise ValueError("min_span_s needs a selection whose arrivals span some time (>= 2 distinct times)")
    period = span * n / (n - 1)
    return 1 + math.ceil((min_span_s - span) / period - 1e-9), period


def trace_sessions(records: list[TraceRecord], scaling: TraceScaling,
                   token_range: TokenRange) -> list[Session]:
    """Scaled single-turn sessions, with arrival offsets (s) from the first timestamp."""
    chosen = _select(records, scaling)
    reps, period = repetitions([a for _, a in chosen], scaling.min_span_s)
    stride = 1 + max((h for rec, _ in chosen for h in rec.hash_ids), default=0)
    sessions = []
    for r in range(reps):
        cache: dict[int, list[int]] = {}
        for i, (rec, arrival) in enumerate(chosen):
            if r:  # a repetition of its own: every hash id moved past all of the previous ones
                rec = replace(rec, hash_ids=tuple(h + r * stride for h in rec.hash_ids))
            if scaling.unique_prefixes:  # ... and each request past all of its repetition's others
                rec = replace(rec, hash_ids=tuple(h + (reps + r * len(chosen) + i) * stride for h in rec.hash_ids))
            prompt = expand_prompt(rec, scaling.block_tokens, token_range, cache, scaling.salt)
            if scaling.max_input_tokens is not None:
                prompt = prompt[:scaling.max_input_tokens]
            out = max(1, rec.output_length)
            if scaling.max_output_tokens is not None:
                out = min(out, scaling.max_output_tokens)
            sessions.append(Session(session_id=f"trace-{rec.line_no}" + (f"-r{r}" if r else ""),
                                    turns=(tuple(prompt),), max_tokens=(out,), arrival_s=arrival + r * period))
    return sessions
