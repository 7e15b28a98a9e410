"""The requests a simulation replays: a Mooncake-format trace, rescaled.

Each trace hash id is one KV block of ``block_tokens`` tokens (ids are
prefix-chained in the format, so an id names its whole prefix); the block key the
scheduler sees is the id as 8 bytes. What-ifs: ``rate_scale`` compresses arrivals
(2: twice the rate), ``time_scale`` multiplies timestamps, and ``reuse_scale``
keeps that fraction of each request's shared leading blocks and replaces the rest
of its chain with fresh blocks (0: no reuse; 1: the trace as is), ``output_scale``
multiplies output lengths (at least one token each). A trace line's class is
its ``service_tier`` field where it has one (an extension of the format); ``flex_share``
marks that fraction of the other requests, drawn by a seeded generator, as flex (the rest:
default). A benchmark's
own prompts can be simulated too (``requests_from_sessions``), to check a
calibrated simulation against the live run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mooncake.bench.trace import TraceRecord, load_trace, scaled_input_length
from mooncake.bench.workloads import Session
from mooncake.blocks import hash_blocks


@dataclass(frozen=True)
class SimRequest:
    req_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    hashes: tuple[bytes, ...]  # full blocks only
    request_class: str = "default"  # its request class (``sched/request_class.py``): "default", "priority" or "flex"


def _key(block_id: int) -> bytes:
    return block_id.to_bytes(8, "little")


def requests_from_records(records: list[TraceRecord], block_tokens: int = 512, rate_scale: float = 1.0,
                          time_scale: float = 1.0, reuse_scale: float = 1.0,
                          max_requests: int | None = None, flex_share: float = 0.0,
                          seed: int = 0, output_scale: float = 1.0) -> list[SimRequest]:
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    if not rate_scale > 0 or not time_scale > 0 or not output_scale > 0:
        raise ValueError("rate_scale, time_scale and output_scale must be > 0")
    if not 0.0 <= reuse_scale <= 1.0:
        raise ValueError("reuse_scale must be within [0, 1]")
    if not 0.0 <= flex_share <= 1.0:
        raise ValueError("flex_share must be within [0, 1]")
    draw = random.Random(seed)
    ordered = sorted(records, key=lambda r: (r.timestamp_ms, r.line_no))
    if max_requests is not None:
        ordered = ordered[:max_requests]
    if not ordered:
        return []
    t0 = ordered[0].timestamp_ms
    seen: set[int] = set()
    fresh = max(max(r.hash_ids) for r in ordered) + 1
    out = []
    for i, rec in enumerate(ordered):
        ids = list(rec.hash_ids)
        shared = 0
        while shared < len(ids) and ids[shared] in seen:
            shared += 1
        seen.update(ids)
        if reuse_scale < 1.0 and shared:
            keep = int(shared * reuse_scale)
            for j in range(keep, len(ids)):  # a changed block changes every block after it
                ids[j] = fresh
                fresh += 1
        n_tokens = scaled_input_length(rec, block_tokens)
        full = n_tokens // block_tokens
        drawn = "flex" if draw.random() < flex_share else "default"  # drawn for every line: the same seed, the same draws
        request_class = rec.request_class or drawn
        out.append(SimRequest(f"r{i}-{rec.line_no}", (rec.timestamp_ms - t0) / 1000.0 * time_scale / rate_scale,
                              n_tokens, max(1, round(rec.output_length * output_scale)), tuple(_key(h) for h in ids[:full]), request_class))
    return out


def requests_from_sessions(sessions: Sequence[Session], block_tokens: int) -> list[SimRequest]:
    """The simulated twin of a benchmark replay: the very prompts ``mooncake bench`` sends
    (single-turn sessions, e.g. a scaled trace), keyed by the serving hash chain of their
    full blocks, so that a simulation and a live run see the same requests and the same
    prefix sharing."""
    out = []
    for i, s in enumerate(sessions):
        if len(s.turns) != 1:
            raise ValueError(f"session {s.session_id} has {len(s.turns)} turns: only single-turn sessions "
                             "can be simulated (a later turn's prompt holds the model's answer)")
        prompt = s.turns[0]
        hashes = hash_blocks(prompt, block_tokens, "sim")
        out.append(SimRequest(f"r{i}-{s.session_id}", s.arrival_s or 0.0, len(prompt), max(1, s.max_tokens[0]),
                              tuple(bytes(h) for h in hashes)))
    return out


def load_requests(path: str | Path, **kwargs) -> list[SimRequest]:
    """Read a Mooncake-format trace (raises ``TraceError`` naming a bad line)."""
    return requests_from_records(load_trace(path), **kwargs)
