"""Join the conductor's admission trace (``sitecustomize.py`` beside this file) with a
``bench_e2e.py`` report: what admission predicted, what it refused and why, and how far the
predicted TTFT was from the realized one (bias, spread, by queue depth / prompt length /
cached fraction).

    python benchmarks/admission_trace/analyze.py TRACE_PREFIX REPORT.json
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from collections import Counter


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def load(prefix: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """First-attempt plan records and first prefilled records, by conductor request id."""
    plans, done = {}, {}
    for path in glob.glob(prefix + ".*"):
        for line in open(path):
            r = json.loads(line)
            if r["kind"] == "plan" and r["attempt"] == 0:
                plans.setdefault(r["req"], r)
            elif r["kind"] == "prefilled":
                done.setdefault(r["req"], r)
    return plans, done


def client_id(req: str) -> int | None:
    head = req.split("-", 1)[0]
    return int(head[1:]) if head.startswith("b") and head[1:].isdigit() else None


def summary(name: str, pairs: list[tuple[float, float]]) -> str:
    """pairs: (predicted, actual) seconds."""
    if not pairs:
        return f"{name}: n=0"
    ratio = [a / p for p, a in pairs if p > 0]
    err = [p - a for p, a in pairs]
    rel = [abs(p - a) / a for p, a in pairs if a > 0]
    return (f"{name}: n={len(pairs)} actual/predicted p10/p50/p90 {pct(ratio, .1):.2f}/{pct(ratio, .5):.2f}/"
            f"{pct(ratio, .9):.2f}; predicted-actual median {statistics.median(err) * 1000:+.0f} ms "
            f"(p10 {pct(err, .1) * 1000:+.0f}, p90 {pct(err, .9) * 1000:+.0f}); |err|/actual median "
            f"{pct(rel, .5):.0%} p90 {pct(rel, .9):.0%}")


def main(prefix: str, report: str) -> None:
    plans, done = load(prefix)
    records = {r["request_id"]: r for r in json.load(open(report))["records"]}
    print(f"plans (first attempts): {len(plans)}; client records: {len(records)}")
    checks = Counter((p["admitted"], p["check"], p["probe"], p.get("warm_up", False)) for p in plans.values())
    for (admitted, check, probe, warm), n in sorted(checks.items()):
        print(f"  {'admitted' if admitted else 'refused '} check={check:5s} probe={probe} warm-up={warm}: {n}")
    refused = [p for p in plans.values() if not p["admitted"]]
    both = Counter((p["best_fail"], p["queue_fail"]) for p in refused)
    print(f"refused: (best_ttft>slo, est_ttft>slack) -> {dict(both)}")
    qref = [p for p in refused if p["check"] == "queue"]
    if qref:
        print(f"queue-check refusals: slack<0 (a queued request already late): {sum(p['slack'] < 0 for p in qref)}/"
              f"{len(qref)}; slack p10/50/90 {pct([p['slack'] for p in qref], .1):.2f}/"
              f"{pct([p['slack'] for p in qref], .5):.2f}/{pct([p['slack'] for p in qref], .9):.2f} s; est_ttft p50 "
              f"{pct([p['est_ttft'] for p in qref], .5):.2f} s; best_ttft p50 {pct([p['best_ttft'] for p in qref], .5):.2f}"
              f" s; queue depth p50 {pct([len(p['entries']) for p in qref], .5)}")
    bref = [p for p in refused if p["check"] == "best"]
    if bref:
        print(f"best-check refusals: best_ttft p10/50/90 {pct([p['best_ttft'] for p in bref], .1):.2f}/"
              f"{pct([p['best_ttft'] for p in bref], .5):.2f}/{pct([p['best_ttft'] for p in bref], .9):.2f} s; "
              f"queue_s p50 {pct([p['queue_s'] for p in bref], .5):.2f}; est_prefill p50 "
              f"{pct([p['est_prefill'] for p in bref], .5):.2f}; tokens p50 {pct([p['tokens'] for p in bref], .5)}")

    rows = []  # (plan, prefilled, client record)
    for rid, p in plans.items():
        d = done.get(rid)
        c = records.get(client_id(rid))
        if p["admitted"] and d is not None:
            rows.append((p, d, c))
    print(f"admitted and prefilled: {len(rows)}")
    short = [(p, d) for p, d, _ in rows if d["cached"] < p["reusable_tokens"]]
    print(f"found fewer cached tokens than planned: {len(short)} ({sum(p['reusable_tokens'] - d['cached'] for p, d in short)}"
          f" tokens computed again; all computed: {sum(d['computed'] for _, d, _ in rows)})")
    big = [(p, d) for p, d, _ in rows if d["computed"] > 500]
    if big:
        print(summary("prefills of > 500 tokens (est_prefill vs reported compute)", [(p["est_prefill"], d["prefill_s"]) for p, d in big]))
    print(summary("TTFT dispatch->first token (conductor)", [(d["est_ttft"], d["since_dispatch"]) for _, d, _ in rows]))
    client = [(p["t"] - p["arrived"] + p["est_ttft"], c["ttft_s"]) for p, _, c in rows if c and c.get("ttft_s")]
    print(summary("TTFT arrival->first token (client)", client))
    print(summary("queue wait (predicted queue_s vs dispatch->first token - own work)",
                  [(p["queue_s"] + p["dispatch_s"], d["since_dispatch"] - d["prefill_s"] - d["fetch_s"]) for p, d, _ in rows]))
    print(summary("own prefill compute (est_prefill vs reported share)",
                  [(p["est_prefill"], d["prefill_s"]) for p, d, _ in rows if d["prefill_s"]]))
    buckets = {
        "queue depth": lambda p, d: "0" if not p["entries"] else "1-2" if len(p["entries"]) <= 2 else "3-5" if len(p["entries"]) <= 5 else "6+",
        "prompt tokens": lambda p, d: "<256" if p["tokens"] < 256 else "256-1023" if p["tokens"] < 1024 else ">=1024",
        "cached fraction": lambda p, d: "<25%" if p["reusable_tokens"] < .25 * p["tokens"] else "25-75%" if p["reusable_tokens"] < .75 * p["tokens"] else ">=75%",
    }
    for name, key in buckets.items():
        groups: dict[str, list] = {}
        for p, d, _ in rows:
            groups.setdefault(key(p, d), []).append((d["est_ttft"], d["since_dispatch"]))
        for k in sorted(groups):
            print("  " + summary(f"{name} {k}", groups[k]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
