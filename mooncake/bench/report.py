"""A run's report: JSON (config, command line, summary, per-request records) and a table."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake.bench.client import RequestRecord

REPORT_VERSION = 1


@dataclass
class Report:
    """Everything a run produced; ``summary`` is :func:`mooncake.bench.metrics.summarize`'s dict."""

    config: dict[str, Any]
    summary: dict[str, Any]
    records: list[RequestRecord]
    model: str
    started_at: str
    command: list[str] = field(default_factory=list)
    label: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "label": self.label,
            "model": self.model,
            "started_at": self.started_at,
            "command": self.command,
            "config": self.config,
            "summary": self.summary,
            "records": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        for key in ("config", "summary", "records"):
            if key not in d:
                raise ValueError(f"not a bench report: missing {key!r}")
        return cls(config=d["config"], summary=d["summary"],
                   records=[RequestRecord.from_dict(r) for r in d["records"]],
                   model=d.get("model", ""), started_at=d.get("started_at", ""),
                   command=d.get("command", []), label=d.get("label"))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Report":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc.msg}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: not a bench report")
        return cls.from_dict(data)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(report: Report) -> str:
    """Human-readable summary for stdout."""
    s = report.summary
    title = f" mooncake bench: {report.label or report.model} "
    rows: list[tuple[str, str]] = [
        ("Model", report.model),
        ("Requests (completed / total)", f"{s['completed']} / {s['requests']}"),
        ("Rejected (429)", _fmt(s["rejected_429"])),
        ("Errors", _fmt(s["errors"]) + (f"  {s['error_statuses']}" if s["errors"] else "")),
        ("Duration (s)", _fmt(s["duration_s"])),
        ("Request throughput (req/s)", _fmt(s["request_throughput"], 3)),
        ("Input token throughput (tok/s)", _fmt(s["input_token_throughput"])),
        ("Output token throughput (tok/s)", _fmt(s["output_token_throughput"])),
        ("Total input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
        ("Prefix hit rate", "-" if s["prefix_hit_rate"] is None else f"{100 * s['prefix_hit_rate']:.1f}%"),
    ]
    if s.get("slos_ms"):
        slos = " ".join(f"{k}<={v:g}ms" for k, v in s["slos_ms"].items())
        rows.append((f"Goodput (req/s) [{slos}]", f"{_fmt(s['goodput'], 3)}  ({s['good_requests']} good)"))
    width = max(len(k) for k, _ in rows) + 2
    lines = [title.center(width + 40, "="), *(f"{k:<{width}}{v}" for k, v in rows)]
    header = f"{'Latency (ms)':<{width}}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}"
    lines += ["-" * (width + 40), header]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2el_ms")):
        st = s[key]
        lines.append(f"{name:<{width}}" + "".join(f"{_fmt(st[q]):>10}" for q in ("mean", "median", "p90", "p99")))
    lines.append("=" * (width + 40))
    return "\n".join(lines)
