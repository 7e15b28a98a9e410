"""Run a benchmark: build the workload, schedule arrivals, stream requests, summarize.

Programmatic entry point: ``report = await run_benchmark(BenchConfig(...))``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import replace
from pathlib import Path

import httpx

from mooncake.bench.arrivals import arrival_times
from mooncake.bench.client import RequestRecord, stream_request
from mooncake.bench.config import BenchConfig
from mooncake.bench.conversation import Conversation, Encoder, RequestOptions
from mooncake.bench.metrics import summarize
from mooncake.bench.progress import ProgressBar
from mooncake.bench.report import Report
from mooncake.bench.trace import load_trace, trace_sessions
from mooncake.bench.workloads import Session, shared_prefix_sessions


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, no model, bad tokenizer...)."""


def build_sessions(cfg: BenchConfig) -> list[Session]:
    """The workload's sessions, in arrival order."""
    if cfg.workload == "trace":
        assert cfg.trace_path is not None
        scaling = cfg.scaling
        if scaling.max_requests is None and cfg.max_requests is not None:
            scaling = replace(scaling, max_requests=cfg.max_requests)  # expand no more than needed
        if scaling.duration_s is None and cfg.duration_s is not None:
            scaling = replace(scaling, duration_s=cfg.duration_s)
        return trace_sessions(load_trace(cfg.trace_path), scaling, cfg.token_range)
    return shared_prefix_sessions(cfg.shared_prefix, cfg.token_range)


def load_encoder(tokenizer: str) -> Encoder:
    """``str -> ids`` from a local HF tokenizer directory or a .gguf file."""
    from transformers import AutoTokenizer  # heavy import, only when needed

    path = Path(tokenizer).expanduser()
    try:
        if path.suffix == ".gguf":
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise BenchError(f"cannot load tokenizer {tokenizer!r}: {exc}") from exc
    return lambda text: list(tok.encode(text, add_special_tokens=False))


async def first_model(client: httpx.AsyncClient, headers: dict[str, str]) -> str:
    """The first model id listed by ``GET /v1/models``."""
    try:
        resp = await client.get("/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {client.base_url}: {exc!r}") from exc
    if resp.status_code != 200:
        raise BenchError(f"GET /v1/models returned {resp.status_code}: {resp.text[:200]}")
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET /v1/models listed no model: {resp.text[:200]}") from None


class _Run:
    """State of one run: shared by its session tasks, discarded afterwards."""

    def __init__(self, cfg: BenchConfig, client: httpx.AsyncClient, options: RequestOptions,
                 headers: dict[str, str], encode: Encoder | None, progress: ProgressBar) -> None:
        self.cfg, self.client, self.options = cfg, client, options
        self.headers, self.encode, self.progress = headers, encode, progress
        limit = cfg.arrival_spec().concurrency
        self.slots = asyncio.Semaphore(limit) if limit else None
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.start = time.perf_counter()

    def _may_issue(self) -> bool:
        if self.cfg.max_requests is not None and self.issued >= self.cfg.max_requests:
            return False
        elapsed = time.perf_counter() - self.start
        return self.cfg.duration_s is None or elapsed < self.cfg.duration_s

    async def _one(self, conv: Conversation, record: RequestRecord) -> str:
        record.start_s = time.perf_counter() - self.start
        text = await stream_request(self.client, self.options.path, conv.body(), record, self.headers)
        if record.prompt_tokens is None and record.ok:
            record.prompt_tokens = conv.prompt_token_count()
        return text

    async def session(self, session: Session, at: float) -> None:
        await asyncio.sleep(max(0.0, self.start + at - time.perf_counter()))
        conv = Conversation(session, self.options, self.encode)
        for turn in range(session.num_requests):
            if not self._may_issue():
                return
            record = RequestRecord(request_id=self.issued, session_id=session.session_id, turn=turn,
                                   start_s=time.perf_counter() - self.start)
            self.issued += 1
            if self.slots is not None:
                async with self.slots:
                    text = await self._one(conv, record)
            else:
                text = await self._one(conv, record)
            self.records.append(record)
            self.progress.update(record)
            if not record.ok:
                return  # a conversation cannot go on without its answer
            conv.record_answer(text)


async def run_benchmark(cfg: BenchConfig, *, encode: Encoder | None = None,
                        command: list[str] | None = None) -> Report:
    """Run ``cfg`` against the server; failed requests are recorded, never raised.

    ``encode`` (text -> token ids) re-encodes answers for multi-turn token
    prompts; by default it is loaded from ``cfg.tokenizer`` when needed.
    """
    sessions = build_sessions(cfg)
    times = arrival_times(cfg.arrival_spec(), sessions)
    if cfg.multi_turn and cfg.prompt_mode == "tokens" and encode is None:
        if not cfg.tokenizer:
            raise BenchError("multi-turn token prompts need --tokenizer (or use --prompt-mode text)")
        encode = load_encoder(cfg.tokenizer)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    total = sum(s.num_requests for s in sessions)
    if cfg.max_requests is not None:
        total = min(total, cfg.max_requests)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits) as client:
        model = cfg.model or await first_model(client, headers)
        options = RequestOptions(model=model, endpoint=cfg.endpoint, prompt_mode=cfg.prompt_mode,
                                 temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
        progress = ProgressBar(total, enabled=cfg.progress)
        run = _Run(cfg, client, options, headers, encode, progress)
        try:
            await asyncio.gather(*(run.session(s, t) for s, t in zip(sessions, times)))
        finally:
            progress.close()
        duration = time.perf_counter() - run.start
    records = sorted(run.records, key=lambda r: r.request_id)
    return Report(config=cfg.to_dict(), summary=summarize(records, duration, cfg.goodput_slos_ms),
                  records=records, model=model, started_at=started_at,
                  command=list(command or []), label=cfg.label)
