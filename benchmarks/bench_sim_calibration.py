"""Does a calibrated simulation predict the live cluster? TTFT p50/p90, simulated vs measured.

A dev cluster on this machine replays the shared trace (reduced as in the end-to-end
benchmark: the requests of its largest prefix groups, 512-token blocks expanded to 16
tokens, prompts <= 1,500 tokens, outputs <= 32, timestamps x 0.1). ``mooncake sim``'s
engine simulates the very same requests (same prompts, same hash chain, same arrival
times) over the same instance counts, calibrated from the cluster's ``GET /cluster``
(its cost models) twice: before the replay (start-up profiles and one warm-up request:
a prediction made before seeing the workload) and after it (cost models refit on the
workload's own requests); see ``mooncake.sim.validate``. Target: TTFT p50 and p90
within +-30%.

    .venv/bin/python benchmarks/bench_sim_calibration.py [--quick] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

from mooncake.bench import BenchConfig
from mooncake.bench.publish import publish
from mooncake.bench.trace import TraceScaling
from mooncake.sim.setup import SimSetup
from mooncake.sim.validate import validate
from mooncake.testing.cluster import running_cluster, small_config

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"
TOLERANCE = 0.30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--quick", action="store_true", help="the two largest prefix groups only")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    scaling = TraceScaling(block_tokens=16, time_scale=0.1, max_input_tokens=1500, max_output_tokens=32,
                           prefix_groups=2 if args.quick else 3)
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-simcal-")))
    cfg.engine.profile_at_start = True  # as served by default: the cost models start from this machine
    with running_cluster(cfg=cfg, prefill=args.prefill) as c:
        model = httpx.get(c.url + "/v1/models").json()["data"][0]["id"]
        httpx.post(c.url + "/v1/completions", json={"model": model, "prompt": [1000, 1001], "max_tokens": 2},
                   timeout=120).raise_for_status()  # warm-up
        bc = BenchConfig(base_url=c.url, workload="trace", trace_path=str(args.trace), scaling=scaling,
                         ignore_eos=True, progress=False, timeout_s=300, label="calibration replay")
        cmp = validate(bc, SimSetup(args.prefill, 1, cfg.conductor.policy, cfg.conductor.use_store),
                       cfg.engine.block_tokens)
    lines = [f"{cmp.requests} requests, {args.prefill} prefill + 1 decode + 1 store; live TTFT "
             f"p50 {cmp.live_p50_s * 1000:.0f} ms, p90 {cmp.live_p90_s * 1000:.0f} ms.", "",
             "| calibrated at | prefill 1k tokens (ms) | decode step b8, 1k tokens each (ms) | sim TTFT p50 (ms) | sim / live p50 "
             "| sim TTFT p90 (ms) | sim / live p90 | within ±30% |",
             "|---|---|---|---|---|---|---|---|"]
    for point, (p50, p90) in cmp.sim.items():
        r50, r90 = cmp.ratios(point)
        hw = cmp.hardware[point]
        ok = abs(r50 - 1) <= TOLERANCE and abs(r90 - 1) <= TOLERANCE
        lines.append(f"| {point} | {hw.prefill_s(1000, 0) * 1000:.0f} | {hw.decode_step_s(8, 8 * 1024) * 1000:.1f} "
                     f"| {p50 * 1000:.0f} | {r50:.2f} | {p90 * 1000:.0f} | {r90:.2f} | {'yes' if ok else 'no'} |")
    text = "\n".join(lines)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
