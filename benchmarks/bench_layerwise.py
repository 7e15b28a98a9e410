"""Layer-wise vs block-wise KV transfer: what is still in flight when prefill ends (issue 12).

One dev cluster per mode (1 prefill, 1 decode, 1 store; one torch thread per process, so each
process stands for one node's fixed compute), one at a time, same prompts: fresh
``--tokens``-token prompts (default 4,000), streaming, ``max_tokens`` 16 with ``ignore_eos``.
Per request: TTFT, the gap from the first to the second token (the second token waits for the
whole KV on decode), and the median gap between later tokens (the request's inter-token latency).
Also the conductor's ``mooncake:kv_inflight_at_prefill_end_bytes`` (KV still queued on the
prefill when it reported the first token).

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_layerwise.py [--reps 3] [--out FILE.md]
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


def run_mode(mode: str, tokens: int, reps: int, max_tokens: int) -> dict:
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-bench-lw-")))
    cfg.engine.kv_transfer = mode  # type: ignore[assignment]
    cfg.engine.kv_cache_bytes = 512 * MiB  # ~11k tokens
    cfg.store.dram_bytes = 1024 * MiB
    cluster = LocalCluster(cfg)
    cluster.start()
    out: dict = {"ttft": [], "first_gap": [], "itl": [], "ratio": []}
    try:
        asyncio.run(stream_one(cluster.url, MODEL, fresh_prompt(999, 64), 4, "layerwise"))  # warm-up
        for rep in range(reps):
            rec = asyncio.run(stream_one(cluster.url, MODEL, fresh_prompt(rep, tokens), max_tokens, "layerwise"))
            gaps = rec.itl_s
            itl = statistics.median(gaps[1:])
            out["ttft"].append(rec.ttft_s)
            out["first_gap"].append(gaps[0])
            out["itl"].append(itl)
            out["ratio"].append(gaps[0] / itl)
            print(f"{mode} rep {rep}: ttft {rec.ttft_s:.3f}s first->second {gaps[0] * 1000:.0f}ms "
                  f"median itl {itl * 1000:.0f}ms ({len(gaps)} gaps)", flush=True)
        m = metrics(cluster.url)
        n = metric(m, "mooncake:kv_inflight_at_prefill_end_bytes_count")
        out["inflight"] = metric(m, "mooncake:kv_inflight_at_prefill_end_bytes_sum") / max(1, n)
    finally:
        cluster.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    results = {mode: run_mode(mode, args.tokens, args.reps, args.max_tokens) for mode in ("block", "layer")}
    med = statistics.median
    lines = [f"| {args.tokens:,}-token prompt | TTFT (s) | first -> second token (ms) | median inter-token (ms) "
             "| first gap / median ITL | KV queued on prefill at its end (MB, mean) |", "|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {mode}-wise | {med(r['ttft']):.2f} | {med(r['first_gap']) * 1000:.0f} | "
                     f"{med(r['itl']) * 1000:.0f} | {med(r['ratio']):.2f}x | {r['inflight'] / 1e6:.1f} |")
    b, lw = results["block"], results["layer"]
    lines.append("")
    lines.append(f"first -> second token, layer-wise vs block-wise: {med(lw['first_gap']) / med(b['first_gap']):.2f}x; "
                 f"TTFT layer-wise vs block-wise: {med(lw['ttft']) / med(b['ttft']):.2f}x")
    table = "\n".join(lines)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
