"""Early rejection: goodput and rejections with and without a TTFT SLO, below and above capacity.

The shared-prefix workload (conversations sharing a long system prefix) at two Poisson
arrival rates, one the cluster keeps up with and one well above what it can serve, against
the same dev cluster configuration (1 prefill + 1 decode + 1 store, one torch thread each)
with ``[admission] ttft_slo_ms`` unset and set. Goodput counts requests that meet TTFT <=
SLO and TPOT <= 300 ms; with the SLO set, requests refused early (429) count as not served.
The point of early rejection: above capacity, goodput should stay near capacity instead of
collapsing under queueing. Also reported: the relative error of the conductor's TTFT
predictions (median, p90) as ``GET /cluster`` accumulates it.

    .venv/bin/python benchmarks/bench_admission.py [--quick] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mooncake.bench import ArrivalSpec, BenchConfig, SharedPrefixSpec, run_benchmark
from mooncake.bench.publish import publish
from mooncake.config import ModelConfig
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.testing.cluster import running_cluster, small_config

SLO_TTFT_MS, SLO_TPOT_MS = 3000.0, 300.0


def run(slo: bool, rates: list[float], duration_s: float, model_dir: str) -> list[dict]:
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-admission-")),
                       ttft_slo_ms=SLO_TTFT_MS if slo else 0.0)
    cfg.engine.profile_at_start = True  # as served by default: the cost models start from this machine
    rows = []
    with running_cluster(cfg=cfg) as c:
        body = {"model": httpx.get(c.url + "/v1/models").json()["data"][0]["id"], "prompt": [1000, 1001],
                "max_tokens": 2}
        httpx.post(c.url + "/v1/completions", json=body, timeout=120).raise_for_status()  # warm
        for rate in rates:
            requests = max(16, int(rate * duration_s))  # long enough above capacity for the backlog to build
            sp = SharedPrefixSpec(groups=2, sessions_per_group=max(1, requests // 4), prefix_tokens=512,
                                  suffix_tokens=64, turns=2, output_tokens=16)
            bc = BenchConfig(base_url=c.url, workload="shared-prefix", shared_prefix=sp, tokenizer=model_dir,
                             arrival=ArrivalSpec(kind="poisson", rate=rate, seed=1), ignore_eos=True,
                             goodput_slos_ms={"ttft": SLO_TTFT_MS, "tpot": SLO_TPOT_MS}, progress=False,
                             timeout_s=300, label=f"slo={slo} rate={rate}")
            t0 = time.perf_counter()
            s = asyncio.run(run_benchmark(bc)).summary
            preds = httpx.get(c.url + "/cluster").json()["predictions"]["ttft"]
            rows.append({"slo": slo, "rate": rate, "requests": s["requests"], "ok": s["completed"],
                         "rejected": s["rejected_429"], "goodput": s["goodput"],
                         "ttft_p50": s["ttft_ms"]["median"], "ttft_p90": s["ttft_ms"]["p90"],
                         "pred_median": preds["median"], "pred_p90": preds["p90"], "pred_n": preds["count"]})
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run (at least 16 requests)")
    ap.add_argument("--rates", type=float, nargs=2, default=[0.3, 3.0], help="below and above capacity (req/s)")
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    model_dir, _ = resolve_model_dir(ModelConfig())
    duration = 10.0 if args.quick else args.duration
    rows = run(False, args.rates, duration, model_dir) + run(True, args.rates, duration, model_dir)
    lines = [f"SLOs: TTFT <= {SLO_TTFT_MS:.0f} ms, TPOT <= {SLO_TPOT_MS:.0f} ms; shared-prefix workload, "
             f"{duration:.0f} s of arrivals per run (at least 16 requests).", "",
             "| TTFT SLO set | rate (req/s) | ok / total | rejected (429) | goodput (req/s) | TTFT p50 / p90 (ms) "
             "| TTFT prediction error median / p90 (n) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'yes' if r['slo'] else 'no'} | {r['rate']} | {r['ok']} / {r['requests']} | {r['rejected']} | "
                     f"{r['goodput']:.3f} | {r['ttft_p50'] or 0:.0f} / {r['ttft_p90'] or 0:.0f} | "
                     f"{r['pred_median']:.0%} / {r['pred_p90']:.0%} ({r['pred_n']}) |")
    text = "\n".join(lines)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
