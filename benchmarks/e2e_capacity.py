"""``bench_e2e.py --capacity``: each system's capacity on each workload.

Capacity is the highest arrival rate at which >= 90% of the requests meet the SLO
(TTFT <= 3 s, TPOT <= 300 ms), searched by :func:`mooncake.bench.capacity.search_capacity`
over the workload's rate scale (geometric steps, then a bounded bisection). Each system
is started once and serves every rate of every workload; each replay draws fresh prompt
tokens (a new trace salt / shared-prefix seed, same sharing structure), so no replay
hits prefixes cached by an earlier one. What does carry over is occupancy: the caches
the earlier replays filled must be evicted (LRU) as a long-running server would.
With ``min_arrival_s`` (``--min-arrival-s``) every replay is the workload repeated until its
arrivals span that long, each repetition on prefixes of its own (``bench_e2e.workloads``):
the same for every system, and attainment is over the whole replay.
After the search, the rates in ``report_scales`` (1x, 2x, 4x) not yet measured are run
too, for the goodput at those rates.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from mooncake.bench import BenchConfig
from mooncake.bench.capacity import CapacityPlan, attainment, search_capacity
from mooncake.bench.runner import build_sessions


def own_rate(kw: dict) -> float:
    """A workload's own arrival rate (requests/s) at scale 1: the trace's requests over its
    arrival span; shared-prefix: conversations/s × turns (later turns wait for answers,
    so this is the nominal offered rate)."""
    if kw["workload"] == "trace":
        cfg = BenchConfig(**{k: v for k, v in kw.items() if k != "tokenizer"})
        times = [s.arrival_s or 0.0 for s in build_sessions(cfg)]
        return (len(times) - 1) / (max(times) - min(times))
    return kw["arrival"].rate * kw["shared_prefix"].turns


def capacity_of(system: str, wl_name: str, make_workload, run_one, plan: CapacityPlan,
                report_scales: list[float], salts: itertools.count) -> dict:
    """Search one system's capacity on one workload. ``make_workload(scale, salt)`` gives the
    BenchConfig arguments; ``run_one(kw, tag)`` replays them against the running system."""
    runs: dict[float, dict] = {}

    def measure(scale: float) -> float:
        summary = run_one(make_workload(scale, next(salts)), f"-x{scale:.3g}")
        runs[scale] = summary
        return attainment(summary)

    result = search_capacity(measure, plan)
    for scale in report_scales:
        if scale not in runs:
            measure(scale)
    base = own_rate(make_workload(1.0, 0))
    return {"system": system, "workload": wl_name, "own_rate": base, "capacity": result.capacity,
            "capped": result.capped, "first_fail": result.first_fail,
            "order": [s for s, _ in result.trials],
            "runs": {scale: dict(summary, attainment=attainment(summary)) for scale, summary in sorted(runs.items())}}


def _f(x, d=2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def runs_table(res: dict) -> str:
    """Every rate tried for one system and workload."""
    rows = [f"#### {res['system']} / {res['workload']}: rates tried (search order "
            f"{', '.join(f'{s:.3g}x' for s in res['order'])})", "",
            "| rate scale | arrival rate (req/s) | in SLO / requests | attainment | goodput (req/s) | "
            "throughput (req/s) | TTFT p50 / p99 (ms) | TPOT p50 (ms) | ITL p50 / p99 (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for scale, s in res["runs"].items():
        itl, ttft = s.get("itl_ms") or {}, s["ttft_ms"]
        rows.append(f"| {scale:.3g}x | {_f(scale * res['own_rate'], 3)} | {s['good_requests']} / {s['requests']} | "
                    f"{_f(s['attainment'])} | {_f(s['goodput'], 3)} | {_f(s['request_throughput'], 3)} | "
                    f"{_f(ttft['median'], 0)} / {_f(ttft['p99'], 0)} | {_f(s['tpot_ms']['median'], 0)} | "
                    f"{_f(itl.get('median'), 0)} / {_f(itl.get('p99'), 0)} |")
    return "\n".join(rows)


def capacity_table(results: list[dict], report_scales: list[float]) -> str:
    """Capacity per system and workload, goodput at the report scales, ratio to llama_server."""
    head = "".join(f"goodput {s:g}x | " for s in report_scales)
    rows = [f"| workload | system | own rate (req/s) | capacity (x) | capacity (req/s) | first failing (x) | "
            f"{head}capacity vs llama_server |", "|---" * (7 + len(report_scales)) + "|"]
    peer = {r["workload"]: r for r in results if r["system"] == "llama_server"}
    for r in results:
        cap = r["capacity"]
        ge = ">= " if r["capped"] else ""
        ref = peer.get(r["workload"])
        ratio = (f"{ge}{cap / ref['capacity']:.2f}x" if cap is not None and ref and ref["capacity"]
                 and not ref["capped"] else "-")
        goods = "".join(_f((r["runs"].get(s) or {}).get("goodput"), 3) + " | " for s in report_scales)
        rows.append(f"| {r['workload']} | {r['system']} | {_f(r['own_rate'], 3)} | "
                    f"{ge}{_f(cap)} | {ge}{_f(None if cap is None else cap * r['own_rate'], 3)} | "
                    f"{_f(r['first_fail'])} | {goods}{ratio} |")
    return "\n".join(rows)


def run_capacity(args, model_dir: str, json_dir: Path) -> tuple[str, list[dict], list[str]]:
    """Every chosen system, started once, through every chosen workload's capacity search."""
    from bench_e2e import SLOS, run_workload, start_system, workloads

    plan = CapacityPlan(start=args.start_scale, growth=2.0, target=0.9, max_scale=args.max_scale,
                        min_scale=args.min_scale, max_rates=args.max_rates, bisect_steps=args.bisect_steps)
    results: list[dict] = []
    failed: list[str] = []
    for system in args.systems:
        try:
            server, target = start_system(system, model_dir, args.dtype, args.llama_server)
        except Exception as exc:
            print(f"[{system}] FAILED to start: {type(exc).__name__}: {exc}", flush=True)
            failed.append(system)
            continue
        salts = itertools.count(1)
        try:
            for name in args.workloads:
                make = lambda scale, salt, name=name: workloads(  # noqa: E731
                    args.quick, model_dir, scale, salt, args.min_arrival_s)[name]
                run = lambda kw, tag, name=name: run_workload(system, name, kw, target, json_dir, tag)  # noqa: E731
                res = capacity_of(system, name, make, run, plan, args.report_scales, salts)
                print(f"[{system}/{name}] capacity {'>= ' if res['capped'] else ''}{res['capacity']}x "
                      f"(first failing {res['first_fail']}x)", flush=True)
                results.append(res)
        except Exception as exc:  # report the others; exit non-zero at the end
            print(f"[{system}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append(system)
        finally:
            server.stop()
    also = ", ".join(f"{s:g}x" for s in args.report_scales) or "no other rate"
    text = [f"Capacity: highest arrival rate with >= {plan.target:.0%} of requests within TTFT <= "
            f"{SLOS['ttft']:.0f} ms and TPOT <= {SLOS['tpot']:.0f} ms; mooncake dtype {args.dtype}; search: x{plan.growth:g} "
            f"from {plan.start:g}x (cap {plan.max_scale:g}x, floor {plan.min_scale:g}x), {plan.bisect_steps} bisection "
            f"steps, <= {plan.max_rates} rates, then {also} if not tried."
            + (f" Sustained: at every rate the workload repeats (fresh prefixes per repetition) until its "
               f"arrivals span >= {args.min_arrival_s:g} s; attainment over the whole replay."
               if args.min_arrival_s else ""),
            "", capacity_table(results, args.report_scales)]
    for res in results:
        text += ["", runs_table(res)]
    return "\n".join(text), results, failed
