"""Benchmark maths: percentiles, TPOT, throughput, goodput, prefix hit rate.

Goodput follows vLLM's benchmark_serving / DistServe: the number of
completed requests that meet every given SLO, divided by the benchmark
duration. Percentiles interpolate linearly (numpy's default), as vLLM does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import numpy as np

from mooncake.bench.client import RequestRecord

SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")
PERCENTILES: tuple[int, ...] = (50, 90, 99)


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 500.0, "tpot": 50.0}`` (ms)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be one of {'|'.join(SLO_METRICS)}:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO value must be a number of ms, got {item!r}") from None
        if not ms > 0:
            raise ValueError(f"goodput SLO must be > 0 ms, got {item!r}")
        slos[name] = ms
    return slos


def latency_stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 of seconds, reported in ms (None when empty)."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(arr, PERCENTILES).tolist()
    return {"mean": float(arr.mean()), "median": p50, "p90": p90, "p99": p99, "count": int(arr.size)}


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """True when a completed request meets every SLO (ms). Fewer than 2 tokens: TPOT is 0."""
    if not record.ok or record.ttft_s is None or record.e2e_s is None:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    return all(values[name] * 1000.0 <= limit for name, limit in slos.items())


def summarize(records: list[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's summary: counts, throughput, goodput, hit rate, latency stats (ms)."""
    done = [r for r in records if r.ok]
    rejected = [r for r in records if r.rejected]
    errors = [r for r in records if not r.ok and not r.rejected]
    dur = max(duration_s, 1e-9)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    output = sum(r.completion_tokens or 0 for r in done)
    with_cache = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    cache_prompt = sum(r.prompt_tokens or 0 for r in with_cache)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(done),
        "rejected_429": len(rejected),
        "errors": len(errors),
        "error_statuses": {str(k): v for k, v in sorted(
            Counter(r.status if r.status is not None else "transport" for r in errors).items(),
            key=lambda kv: str(kv[0]))},
        "duration_s": duration_s,
        "request_throughput": len(done) / dur,
        "input_token_throughput": prompt / dur,
        "output_token_throughput": output / dur,
        "total_token_throughput": (prompt + output) / dur,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in with_cache),
        "prefix_hit_rate": (sum(r.cached_tokens or 0 for r in with_cache) / cache_prompt
                            if cache_prompt else None),
        "ttft_ms": latency_stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": latency_stats_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": latency_stats_ms([g for r in done for g in r.itl_s]),
        "e2el_ms": latency_stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "slos_ms": dict(slos or {}),
        "goodput": None,
        "good_requests": None,
    }
    if slos:
        good = sum(1 for r in done if meets_slos(r, slos))
        summary["good_requests"] = good
        summary["goodput"] = good / dur
    return summary
