"""Chunked pipeline parallelism: TTFT of a long prompt on a 2- and 3-stage pipeline group vs one
prefill instance (issue 12).

One dev cluster per setup, one after the other, the same fresh ``--tokens``-token prompts (default
6,000), streaming, ``max_tokens`` 4: one instance (1 prefill, ``cpp_group_size`` 1), a 2-stage group
(2 prefills, ``cpp_group_size`` 2), a 3-stage group (3 prefills, ``cpp_group_size`` 3); each with
1 decode and 1 store, **one torch thread per process** (each process stands for one node's fixed
compute), 512-token chunks, float32. Also, from the conductor's metrics: requests served by a
group, per-stage compute and idle seconds, activation bytes handed on.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_pipeline.py [--reps 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from mooncake.bench.publish import publish
from mooncake.config import MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL, metric, metrics
from mooncake.testing.cluster import small_config

from one_request import fresh_prompt, stream_one


def run_setup(stages: int, tokens: int, reps: int, seed0: int) -> dict:
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-bench-cpp-")), cpp_group_size=stages)
    cfg.engine.kv_cache_bytes = 512 * MiB  # ~11k tokens
    cfg.store.dram_bytes = 1024 * MiB
    cluster = LocalCluster(cfg, prefill=stages)
    cluster.start(timeout_s=300)
    out: dict = {"ttft": [], "texts": []}
    try:
        asyncio.run(stream_one(cluster.url, MODEL, fresh_prompt(999, 64), 2, "pipeline"))  # warm-up (short: one instance)
        for rep in range(reps):
            rec = asyncio.run(stream_one(cluster.url, MODEL, fresh_prompt(seed0 + rep, tokens), 4, "pipeline"))
            out["ttft"].append(rec.ttft_s)
            print(f"{stages} stage(s) rep {rep}: ttft {rec.ttft_s:.3f}s", flush=True)
        m = metrics(cluster.url)
        out["groups"] = metric(m, "mooncake:pipeline_requests_total")
        out["compute"] = [metric(m, "mooncake:pipeline_stage_compute_seconds_total", stage=str(i)) for i in range(stages)]
        out["idle"] = [metric(m, "mooncake:pipeline_stage_idle_seconds_total", stage=str(i)) for i in range(stages)]
        out["act_bytes"] = metric(m, "mooncake:pipeline_activation_bytes_total")
    finally:
        cluster.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    results = {s: run_setup(s, args.tokens, args.reps, 0) for s in args.stages}
    med = statistics.median
    base = med(results[args.stages[0]]["ttft"])
    lines = [f"| {args.tokens:,}-token prompt | prefill processes | median TTFT (s) | vs one instance | per rep (s) "
             "| served by a group | stage compute s / idle s (per request, mean) | activations per request (MB) |",
             "|---|---|---|---|---|---|---|---|"]
    for s, r in results.items():
        n = max(1.0, r["groups"])
        stage_cols = ", ".join(f"{c / n:.1f} / {i / n:.1f}" for c, i in zip(r["compute"], r["idle"])) if r["groups"] else "—"
        lines.append(f"| {'one instance' if s == 1 else f'{s}-stage group'} | {s} | {med(r['ttft']):.2f} | "
                     f"{med(r['ttft']) / base:.2f}x | {', '.join(f'{t:.2f}' for t in r['ttft'])} | "
                     f"{int(r['groups'])} of {args.reps} | {stage_cols} | {r['act_bytes'] / n / 1e6:.1f} |")
    table = "\n".join(lines)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
