"""``mooncake sim``: simulator speed, the paper's policy comparison, and cluster sizing.

1. Speed: the shared trace (3,993 requests) and a 12,000-request trace (the shared
   trace replayed back to back with fresh block ids per copy) over 16 prefill + 16
   decode instances, a800x8-llama2-70b, per policy: ``sim_wall_s``.
2. Policies (16 + 16, a800x8-llama2-70b): average TTFT of the paper's four
   schedulers -- random, load balancing, local cache-aware, global cache-aware --
   as ``random --no-store``, ``least_loaded --no-store``, ``cache_aware --no-store``
   and ``cache_aware`` (only global cache-aware reads the store pool), plus random
   and least_loaded with the pool, on the shared trace at 1x and 2x its rate and
   on a generated chat-like trace (multi-turn, 64 system prompts, ~11,800 requests).
3. Sizing: ``size_cluster`` on the shared trace at three SLO pairs (frontier PNGs),
   and once on the 12,000-request trace (its wall time).

    flock /tmp/mooncake-cpu.lock .venv/bin/python benchmarks/bench_sim.py --out benchmarks/sim
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mooncake.bench.trace import load_trace
from mooncake.sim.plot import plot_frontier
from mooncake.sim.profiles import hardware_for
from mooncake.sim.setup import SimSetup
from mooncake.sim.simulator import simulate
from mooncake.sim.size import size_cluster
from mooncake.sim.synthetic import ChatTraceSpec, chat_trace, concatenate
from mooncake.sim.workload import requests_from_records

TRACE = "/work/shared/traces/synthetic_trace.jsonl"
PROFILE = "a800x8-llama2-70b"
PAPER = {"random": 19.65, "least_loaded": 5.27, "cache_aware --no-store": 3.58, "cache_aware": 3.07}
VARIANTS = (("random --no-store", "random", False), ("least_loaded --no-store", "least_loaded", False),
            ("cache_aware --no-store", "cache_aware", False), ("cache_aware", "cache_aware", True),
            ("random (store on)", "random", True), ("least_loaded (store on)", "least_loaded", True))
SLO_PAIRS = ((10000.0, 30.0, 0.9), (20000.0, 28.0, 0.9), (6000.0, 50.0, 0.9))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/sim", help="directory for JSON and PNGs")
    ap.add_argument("--parts", default="speed,policies,size", help="comma-separated subset to run")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    out = Path(args.out)
    if "replot" in parts:  # redraw the frontier PNGs from a recorded size run
        replot(out)
        return
    out.mkdir(parents=True, exist_ok=True)
    hw = hardware_for(PROFILE, 512)
    records = load_trace(TRACE)
    shared = requests_from_records(records)
    big = requests_from_records(concatenate(records, 4), max_requests=12000)
    chat = requests_from_records(chat_trace(ChatTraceSpec(conversations=3000, rate_per_s=5, system_prompts=64,
                                                          question_tokens=1500, seed=1)))
    report: dict = {"profile": PROFILE, "speed": [], "policies": {}, "size": []}

    for name, reqs in (("shared trace", shared), ("12k trace", big)) if "speed" in parts else ():
        for label, policy, store in VARIANTS[:4]:
            r = simulate(SimSetup(16, 16, policy, store), hw, reqs)
            report["speed"].append({"trace": name, "requests": len(reqs), "variant": label, "sim_wall_s": r.sim_wall_s})
            print(f"speed {name} {label}: {r.sim_wall_s:.2f} s", flush=True)

    for name, reqs, rate in (("shared trace 1x", shared, 1.0), ("shared trace 2x", shared, 2.0),
                             ("chat-like trace", chat, 1.0)) if "policies" in parts else ():
        if rate != 1.0:
            reqs = requests_from_records(records, rate_scale=rate)
        rows = []
        for label, policy, store in VARIANTS:
            r = simulate(SimSetup(16, 16, policy, store), hw, reqs)
            rows.append({"variant": label, "requests": r.requests, "ttft_mean_s": r.ttft_mean_s,
                         "ttft_p90_s": r.ttft_p90_s, "queue_mean_s": r.queue_mean_s,
                         "cache_hit_rate": r.cache_hit_rate, "prefill_utilization": r.prefill_utilization})
            print(f"policy {name} {label}: ttft mean {r.ttft_mean_s:.2f} p90 {r.ttft_p90_s:.2f} "
                  f"hit {r.cache_hit_rate:.2f}", flush=True)
        report["policies"][name] = rows

    for tag, reqs, pairs in (("shared", shared, SLO_PAIRS), ("12k", big, SLO_PAIRS[:1])) if "size" in parts else ():
        for ttft, tbt, target in pairs:
            t0 = time.perf_counter()
            template = SimSetup(1, 1, "cache_aware", True, ttft, tbt)
            answer = size_cluster(reqs, hw, template, target, 64, 64, full_frontier=tag == "shared")
            wall = time.perf_counter() - t0
            if tag == "shared":
                plot_frontier(answer, str(_png(out, ttft, tbt)), _title(ttft, tbt, target))
            entry = {"trace": tag, "requests": len(reqs), "ttft_slo_ms": ttft, "tbt_slo_ms": tbt, "target": target,
                     "wall_s": wall, "simulations": len(answer.evaluated), **answer.to_dict()}
            report["size"].append(entry)
            print(f"size {tag} TTFT {ttft} TBT {tbt}: best {answer.best} frontier {answer.frontier} "
                  f"({len(answer.evaluated)} sims, {wall:.1f} s)", flush=True)

    report["paper_avg_ttft_s"] = PAPER
    (out / f"bench_sim-{'-'.join(sorted(parts))}.json").write_text(json.dumps(report, indent=1) + "\n")


def _png(out: Path, ttft: float, tbt: float) -> Path:
    return out / f"size-shared-ttft{int(ttft)}-tbt{int(tbt)}.png"


def _title(ttft: float, tbt: float, target: float) -> str:
    return f"shared trace (3,993 req): TTFT {ttft / 1000:g} s, TBT {tbt:g} ms, attainment >= {target:g}, cache_aware"


def replot(out: Path) -> None:
    from types import SimpleNamespace

    from mooncake.sim.size import SizeAnswer

    for e in json.loads((out / "bench_sim-size.json").read_text())["size"]:
        if e["trace"] != "shared":
            continue
        best = (e["best"]["prefill"], e["best"]["decode"]) if e["best"] else None
        answer = SizeAnswer(e["target"], best, [(f["prefill"], f["decode"]) for f in e["frontier"]],
                            {(x["prefill"], x["decode"]): SimpleNamespace(slo_attainment=x["slo_attainment"])
                             for x in e["evaluated"]})
        plot_frontier(answer, str(_png(out, e["ttft_slo_ms"], e["tbt_slo_ms"])),
                      _title(e["ttft_slo_ms"], e["tbt_slo_ms"], e["target"]))


if __name__ == "__main__":
    main()
