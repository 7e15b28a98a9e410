"""Where colocated and disaggregated serving cross, in the simulator.

For each point of a grid (prefix reuse ``--reuse-scale``, output length ``--output-scale``, TBT
SLO) ``size_cluster`` sizes both designs over the same requests: the fewest prefill + decode
instances, and the fewest colocated instances at their best step budget, whose SLO attainment
reaches the target. Each instance is the profile's whole machine (A800 profile: 8 GPUs, TP 8),
so the instance counts compare hardware. Printed: the table, which design needs fewer where, and
the review's roofline argument with this profile's numbers; written: the same as JSON.

    flock /tmp/mooncake-cpu.lock .venv/bin/python benchmarks/bench_crossover.py --json benchmarks/sim/crossover.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from mooncake.bench.trace import load_trace
from mooncake.sim.colocated_steps import ENGINE_BLOCK, step_budget
from mooncake.sim.profiles import hardware_for
from mooncake.sim.setup import SimSetup
from mooncake.sim.size import SizeAnswer, size_cluster
from mooncake.sim.workload import SimRequest, requests_from_records

TRACE = "/work/shared/traces/synthetic_trace.jsonl"
ROOFLINE_BATCH = 8  # the decode batch the roofline figures are worked at (the live role's budget rule's)


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def point(answer: SizeAnswer, reqs: list[SimRequest], reuse: float, output_scale: float, tbt: float,
          wall_s: float) -> dict:
    designs = answer.designs()
    best = answer.evaluated.get(answer.best) if answer.best else None
    colocated = answer.colocated_evaluated.get((answer.colocated, answer.colocated_step_tokens))
    served = best or colocated
    return {"reuse_scale": reuse, "output_scale": output_scale, "tbt_slo_ms": tbt,
            "mean_output_tokens": sum(r.output_tokens for r in reqs) / len(reqs),
            "cache_hit_rate": served.cache_hit_rate if served else None,
            "disaggregated": None if answer.best is None else {"prefill": answer.best[0], "decode": answer.best[1]},
            "colocated": answer.colocated, "colocated_step_tokens": answer.colocated_step_tokens or None,
            **{k: designs[k] for k in ("fewer", "saved_instances", "ratio")},
            "simulations": len(answer.evaluated) + len(answer.colocated_evaluated), "wall_s": wall_s}


def row(p: dict) -> str:
    d = p["disaggregated"]
    disagg = f"{d['prefill']}+{d['decode']} = {d['prefill'] + d['decode']}" if d else "none"
    colo = f"{p['colocated']} @ {p['colocated_step_tokens']}" if p["colocated"] else "none"
    by = f"{p['saved_instances']}" if p["saved_instances"] is not None else "-"
    hit = f"{p['cache_hit_rate']:.2f}" if p["cache_hit_rate"] is not None else "-"
    return (f"| {p['reuse_scale']:g} | {hit} | {p['output_scale']:g} ({p['mean_output_tokens']:.0f}) | "
            f"{p['tbt_slo_ms']:g} | {disagg} | {colo} | **{p['fewer']}** | {by} |")


def roofline(hw, reqs: list[SimRequest], tbt_slos: list[float]) -> dict:
    """The review's argument with this profile's numbers, for the mean request: the KV move a
    disaggregated cluster pays once per request, against what a TBT SLO lets a colocated instance
    prefill while it decodes a batch of ``ROOFLINE_BATCH``."""
    P = int(sum(r.prompt_tokens for r in reqs) / len(reqs))
    O = sum(r.output_tokens for r in reqs) / len(reqs)
    b, ctx = ROOFLINE_BATCH, ROOFLINE_BATCH * (P + O / 2)
    move_s = hw.kv_transfer_s(P)
    decode_s = hw.decode_step_s(b, ctx)
    free = max((n for n in range(ENGINE_BLOCK, hw.chunk_tokens + 1, ENGINE_BLOCK)
                if hw.mixed_step_s(b, ctx, [(n, P // 2)]) <= decode_s * (1 + 1e-9)), default=0)
    by_slo = []
    for slo in tbt_slos:
        budget = step_budget(hw, slo)
        mixed_s = hw.mixed_step_s(b, ctx, [(max(1, budget - b), P // 2)])
        by_slo.append({"tbt_slo_ms": slo, "step_tokens": budget, "mixed_step_s": mixed_s,
                       "prompt_tokens_per_s": max(1, budget - b) / mixed_s})
    return {"mean_prompt_tokens": P, "mean_output_tokens": O, "kv_bytes_per_token": hw.kv_bytes_per_token,
            "kv_move_s": move_s, "kv_move_visible_s": hw.kv_handoff_s(P, hw.prefill_s(P, 0)),
            "kv_move_per_output_token_s": move_s / O, "batch": b, "decode_step_s": decode_s,
            "free_chunk_tokens": free, "prefill_tokens_per_s": P / hw.prefill_s(P, 0), "by_tbt_slo": by_slo}


def print_roofline(r: dict) -> None:
    mib = r["kv_bytes_per_token"] / 2**20
    print(f"""
The roofline argument, with this profile's figures (mean prompt {r['mean_prompt_tokens']:,} tokens, mean output {r['mean_output_tokens']:.0f}):
- Disaggregation moves each prompt's KV once: {r['mean_prompt_tokens']:,} tokens x {mib:.2f} MiB, {r['kv_move_s'] * 1e3:.1f} ms on the link,
  {r['kv_move_visible_s'] * 1e3:.2f} ms of it after prefill ends (layer-wise): {r['kv_move_per_output_token_s'] * 1e3:.3f} ms per output token. Paid once per
  request, it is amortized over the output; on this fabric after a few tokens.
- What disaggregation gives up is the decode step's idle compute. A step of {r['batch']} sequences is memory-bound
  ({r['decode_step_s'] * 1e3:.1f} ms) and could carry {r['free_chunk_tokens']} prompt tokens at no cost; a colocated instance uses it. Past that,
  every prompt token lengthens the step for every decoding sequence, so the TBT SLO caps the chunk,
  and with it what a colocated instance prefills while it decodes (a prefill instance: {r['prefill_tokens_per_s']:,.0f} tokens/s):""")
    print("\n| TBT SLO (ms) | step tokens | step with a chunk (ms) | prompt tokens/s while decoding |\n|---|---|---|---|")
    for s in r["by_tbt_slo"]:
        print(f"| {s['tbt_slo_ms']:g} | {s['step_tokens']} | {s['mixed_step_s'] * 1e3:.1f} | {s['prompt_tokens_per_s']:,.0f} |")
    print("""
- Hence the crossover: where the TBT SLO leaves colocated instances little room for prompts (a tight
  SLO; long outputs, with more sequences decoding at once and a higher memory floor), the
  disaggregated cluster, whose decode pool keeps steps short, needs fewer instances. Where the SLO
  lets them prefill at nearly a prefill instance's rate, colocated instances save the decode pool a
  disaggregated cluster keeps beside its prefill pool, which counts most where that pool is small.""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--profile", default="a800x8-llama2-70b")
    ap.add_argument("--max-requests", type=int, default=1000, help="the first N requests (default: %(default)s)")
    ap.add_argument("--reuse", type=floats, default=[1.0, 0.0], help="--reuse-scale values (default: 1,0)")
    ap.add_argument("--outputs", type=floats, default=[0.25, 1.0, 4.0], help="--output-scale values (default: 0.25,1,4)")
    ap.add_argument("--tbt", type=floats, default=[30.0, 100.0, 300.0], help="TBT SLOs in ms (default: 30,100,300)")
    ap.add_argument("--ttft-slo-ms", type=float, default=10_000.0)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--max-prefill", type=int, default=16)
    ap.add_argument("--max-decode", type=int, default=16)
    ap.add_argument("--max-colocated", type=int, default=32)
    ap.add_argument("--json", metavar="OUT", help="write the points and the roofline figures")
    args = ap.parse_args()
    hw = hardware_for(args.profile, 512)
    records = load_trace(args.trace)
    t0 = time.perf_counter()
    points = []
    print(f"{args.trace.split('/')[-1]}, first {args.max_requests} requests, {hw.name}, TTFT SLO {args.ttft_slo_ms:g} ms, "
          f"attainment >= {args.attainment:g}; instances: disaggregated prefill+decode, colocated N @ step tokens\n")
    print("| reuse scale | hit rate | output scale (mean tokens) | TBT SLO (ms) | disaggregated | colocated | fewer | by |")
    print("|---|---|---|---|---|---|---|---|")
    workloads = {(reuse, output_scale): requests_from_records(records, max_requests=args.max_requests, reuse_scale=reuse,
                                                             output_scale=output_scale)
                 for reuse, output_scale in itertools.product(args.reuse, args.outputs)}
    for reuse, output_scale, tbt in itertools.product(args.reuse, args.outputs, args.tbt):
        reqs = workloads[reuse, output_scale]
        t = time.perf_counter()
        answer = size_cluster(reqs, hw, SimSetup(1, 1, ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=tbt),
                              args.attainment, args.max_prefill, args.max_decode, max_colocated=args.max_colocated)
        points.append(point(answer, reqs, reuse, output_scale, tbt, time.perf_counter() - t))
        print(row(points[-1]), flush=True)
    wins = {k: sum(p["fewer"] == k for p in points) for k in ("colocated", "disaggregated", "tie")}
    print(f"\ncolocated needs fewer at {wins['colocated']} points, disaggregated at {wins['disaggregated']}, "
          f"ties at {wins['tie']} (of {len(points)}; {time.perf_counter() - t0:.0f} s)")
    unscaled = workloads.get((1.0, 1.0)) or requests_from_records(records, max_requests=args.max_requests)
    figures = roofline(hw, unscaled, args.tbt)
    print_roofline(figures)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "trace": args.trace, "profile": hw.name, "max_requests": args.max_requests,
            "ttft_slo_ms": args.ttft_slo_ms, "attainment": args.attainment,
            "bounds": {"prefill": args.max_prefill, "decode": args.max_decode, "colocated": args.max_colocated},
            "points": points, "wins": wins, "roofline": figures, "wall_s": time.perf_counter() - t0}, indent=1) + "\n")


if __name__ == "__main__":
    main()
