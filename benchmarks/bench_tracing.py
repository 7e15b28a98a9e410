"""Tracing's cost (issue 55): batch-1 decode and a trace replay on `mooncake serve`'s default
(one colocated instance) with tracing off and on at ratio 1, in one run. "On" exports every
role's spans to a local OTLP/HTTP receiver in this process (``mooncake.testing.otlp_sink``), as a
collector would take them; its span count is reported.

Per mode: a fresh cluster, one warm-up request, then ``--reps`` streamed greedy completions of
``--tokens`` tokens after fresh ``--prompt-tokens``-token prompts, one at a time (decode tokens/s:
tokens after the first over the time from the first to the last streamed token, median; TTFT
median); then ``--trace-requests`` requests of the synthetic Mooncake trace (as bench_e2e's quick
trace: 16-token blocks, at most 32 output tokens, 0.1 x its timestamps), its TTFT/TPOT medians and
output throughput. The modes alternate ``--rounds`` times (off, on, off, on, ...; ``--first on``:
on, off, ...) so that drift of a shared machine falls on both.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=benchmarks .venv/bin/python benchmarks/bench_tracing.py \\
        [--reps 5] [--tokens 64] [--prompt-tokens 256] [--trace-requests 24] [--rounds 1] [--first off|on]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench_e2e import TRACE, start_local
from one_request import fresh_prompt, stream_one
from mooncake.bench import BenchConfig, TraceScaling, run_benchmark
from mooncake.config import Config
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.otlp_sink import OTLPSink
from mooncake.testing.ports import free_port

MODEL = "SmolLM2-135M-Instruct"


def start(traced_to: str) -> LocalCluster:
    cfg = Config()
    cfg.frontend.port = free_port()
    cfg.store.data_dir = tempfile.mkdtemp(prefix="mooncake-tracing-")
    cfg.observability.otlp_endpoint = traced_to
    return start_local(cfg, prefill=0, decode=0, colocated=1)


async def batch1(url: str, reps: int, tokens: int, prompt_tokens: int, seed: int) -> dict:
    await stream_one(url, MODEL, fresh_prompt(seed, prompt_tokens), 4, "warm")
    tok_s, ttft = [], []
    for i in range(reps):
        rec = await stream_one(url, MODEL, fresh_prompt(seed + 1 + i, prompt_tokens), tokens, "batch1")
        decode_s = sum(rec.itl_s)
        tok_s.append(((rec.completion_tokens or 0) - 1) / decode_s)
        ttft.append(rec.ttft_s)
    return {"decode_tok_s": statistics.median(tok_s), "decode_tok_s_all": tok_s, "ttft_ms": 1e3 * statistics.median(ttft)}


async def replay(url: str, n: int, salt: int) -> dict:
    scaling = TraceScaling(block_tokens=16, time_scale=0.1, max_input_tokens=1500, max_output_tokens=32,
                           max_requests=n, prefix_groups=3, salt=salt)
    cfg = BenchConfig(base_url=url, model=MODEL, workload="trace", trace_path=TRACE, max_requests=n, scaling=scaling,
                      progress=False, label="trace")
    s = (await run_benchmark(cfg)).summary
    return {"completed": s["completed"], "errors": s["errors"], "output_tok_s": s["output_token_throughput"],
            "ttft_p50_ms": s["ttft_ms"].get("median"), "tpot_p50_ms": s["tpot_ms"].get("median"),
            "duration_s": s["duration_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--trace-requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--first", choices=["off", "on"], default="off", help="the mode each round starts with")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sink = OTLPSink()
    runs: list[dict] = []
    try:
        for rnd in range(args.rounds):
            for mode in ("off", "on") if args.first == "off" else ("on", "off"):
                before = len(sink.spans)
                cluster = start(sink.endpoint if mode == "on" else "")
                try:
                    seed = 1000 * (2 * rnd + (mode == "on")) + 17
                    b1 = asyncio.run(batch1(cluster.url, args.reps, args.tokens, args.prompt_tokens, seed))
                    tr = asyncio.run(replay(cluster.url, args.trace_requests, salt=seed))
                finally:
                    cluster.stop()
                time.sleep(1.5)  # the last batches of spans
                run = {"mode": mode, "round": rnd, "batch1": b1, "trace": tr, "spans": len(sink.spans) - before}
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        sink.close()
    for mode in ("off", "on"):
        mine = [r for r in runs if r["mode"] == mode]
        print(f"tracing {mode:3}: batch-1 decode {statistics.median(r['batch1']['decode_tok_s'] for r in mine):6.2f} tok/s, "
              f"TTFT {statistics.median(r['batch1']['ttft_ms'] for r in mine):7.1f} ms | trace replay "
              f"{statistics.median(r['trace']['output_tok_s'] for r in mine):6.2f} out tok/s, TTFT p50 "
              f"{statistics.median(r['trace']['ttft_p50_ms'] or 0 for r in mine):7.1f} ms, TPOT p50 "
              f"{statistics.median(r['trace']['tpot_p50_ms'] or 0 for r in mine):6.1f} ms | spans {sum(r['spans'] for r in mine)}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
