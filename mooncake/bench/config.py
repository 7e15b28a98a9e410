"""BenchConfig: everything one benchmark run needs, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from mooncake.bench.arrivals import ArrivalSpec
from mooncake.bench.conversation import Endpoint, PromptMode
from mooncake.bench.metrics import SLO_METRICS
from mooncake.bench.prompts import TokenRange
from mooncake.bench.trace import TraceScaling
from mooncake.bench.workloads import SharedPrefixSpec

WorkloadKind = Literal["trace", "shared-prefix"]


@dataclass(frozen=True)
class BenchConfig:
    """One run: target server, workload, arrivals, request options, SLOs."""

    base_url: str = "http://127.0.0.1:8000"
    """Server root; requests go to ``{base_url}/v1/...``."""
    model: str | None = None
    """Model name; None: the first one listed by ``GET /v1/models``."""
    api_key: str | None = None
    endpoint: Endpoint = "completions"
    prompt_mode: PromptMode = "tokens"
    temperature: float = 0.0
    ignore_eos: bool = False
    workload: WorkloadKind = "trace"
    trace_path: str | None = None
    scaling: TraceScaling = field(default_factory=TraceScaling)
    shared_prefix: SharedPrefixSpec = field(default_factory=SharedPrefixSpec)
    token_range: TokenRange = field(default_factory=TokenRange)
    arrival: ArrivalSpec | None = None
    """None: the trace's timestamps for a trace, a closed loop of 4 otherwise."""
    max_requests: int | None = None
    """Stop issuing requests after this many (every turn counts)."""
    duration_s: float | None = None
    """Stop issuing requests this many seconds after the start."""
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 600.0
    """Per-request timeout (connect, and each read between chunks)."""
    tokenizer: str | None = None
    """HF directory or .gguf file, to re-encode answers for multi-turn token prompts."""
    label: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.workload == "trace" and not self.trace_path:
            raise ValueError("the trace workload needs a trace file")
        if self.endpoint == "chat" and self.prompt_mode == "tokens":
            raise ValueError("the chat endpoint takes text prompts: use prompt mode 'text'")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("duration_s must be > 0")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        unknown = set(self.goodput_slos_ms) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"unknown goodput SLOs {sorted(unknown)}; known: {SLO_METRICS}")
        if self.arrival_spec().kind == "trace" and self.workload != "trace":
            raise ValueError("arrival 'trace' needs the trace workload")

    def arrival_spec(self) -> ArrivalSpec:
        """The arrival process, with the workload's default filled in."""
        if self.arrival is not None:
            return self.arrival
        if self.workload == "trace":
            return ArrivalSpec(kind="trace")
        return ArrivalSpec(kind="concurrency", concurrency=4)

    @property
    def multi_turn(self) -> bool:
        return self.workload == "shared-prefix" and self.shared_prefix.turns > 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arrival"] = asdict(self.arrival_spec())
        if d.get("api_key"):
            d["api_key"] = "***"
        return d
