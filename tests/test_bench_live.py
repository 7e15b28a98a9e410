"""``mooncake bench`` (the real CLI) against a live dev cluster: a complete JSON report.
Shapes: the default dev cluster only: it checks the bench CLI's report, not a promise of a shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mooncake.testing.cluster import start_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("bench-live"))
    yield c
    c.stop()


def test_bench_cli_shared_prefix_report(cluster, tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "mooncake.cli", "bench", "--url", cluster.url,
           "--workload", "shared-prefix", "--groups", "2", "--sessions-per-group", "2",
           "--prefix-len", "96", "--suffix-len", "8", "--turns", "1", "--output-len", "4",
           "--arrival", "concurrency", "--concurrency", "1", "--ignore-eos",
           "--goodput", "ttft:60000", "tpot:60000", "--out", str(out), "--no-progress", "--label", "live"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())

    for key in ("version", "model", "started_at", "command", "config", "summary", "records"):
        assert key in report, key
    s = report["summary"]
    for key in ("requests", "completed", "rejected_429", "errors", "duration_s", "request_throughput",
                "output_token_throughput", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                "prefix_hit_rate", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "goodput", "good_requests"):
        assert key in s, key
    assert s["requests"] == 4 and s["completed"] == 4
    assert s["errors"] == 0 and s["rejected_429"] == 0
    assert len(report["records"]) == 4
    assert s["total_output_tokens"] == 4 * 4
    assert s["ttft_ms"] and s["ttft_ms"]["median"] > 0
    assert s["good_requests"] == 4 and s["goodput"] > 0
    # One closed-loop request at a time: each group's later sessions find the 96-token prefix
    # (6 full blocks of 16) already cached.
    assert s["total_cached_tokens"] > 0
    assert 0 < s["prefix_hit_rate"] <= 1
    cached = sorted(r.get("cached_tokens") or 0 for r in report["records"])
    assert cached[-1] >= 80, cached
    assert report["label"] == "live"
