"""Where a replay with SLOs set loses requests that could have been served in SLO: admitted but
missed (by TTFT, TPOT or both, by prompt length and cached fraction), and refused requests that
would probably have made it, estimated from the admitted requests' realized / predicted TTFT in
the same prompt-length class (the share of admitted samples for which ``predicted * ratio`` stays
within the SLO). The estimate ignores the load an admitted request adds; it bounds what a better
decision could win, it is not a counterfactual replay. For the queue check's refusals it also
finds the request each refusal protected (the earliest deadline among those queued ahead that
were predicted to meet theirs, matched by its booking time) and reports how that one fared.

    python benchmarks/admission_trace/losses.py TRACE_PREFIX REPORT.json [TTFT_SLO_S TPOT_SLO_S]
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict

from analyze import client_id, load, pct


def length_class(tokens: int, cached: int) -> str:
    size = "<256" if tokens < 256 else "256-1023" if tokens < 1024 else ">=1024"
    return f"{size} {'cold' if cached < 0.25 * tokens else 'warm'}"


def main(prefix: str, report: str, ttft_slo: float = 3.0, tpot_slo: float = 0.3) -> None:
    plans, _ = load(prefix)
    records = {r["request_id"]: r for r in json.load(open(report))["records"]}
    ratios: dict[str, list[float]] = defaultdict(list)  # class -> client TTFT / predicted TTFT
    outcome: Counter[tuple[str, str]] = Counter()
    for rid, p in plans.items():
        c = records.get(client_id(rid))
        if c is None:
            continue
        cls = length_class(p["tokens"], p["reusable_tokens"])
        if not p["admitted"]:
            outcome[(cls, f"refused:{p['check']}")] += 1
            continue
        if not c.get("ok"):
            outcome[(cls, "admitted:failed")] += 1
            continue
        ttft_ok = c["ttft_s"] <= ttft_slo
        tpot_ok = (c.get("tpot_s") or 0.0) <= tpot_slo
        outcome[(cls, "admitted:" + ("in SLO" if ttft_ok and tpot_ok else "miss TTFT" if tpot_ok
                                     else "miss TPOT" if ttft_ok else "miss both"))] += 1
        if p["est_ttft"] > 0:
            ratios[cls].append(c["ttft_s"] / (p["t"] - p["arrived"] + p["est_ttft"]))
    classes = sorted({k for k, _ in outcome})
    kinds = sorted({v for _, v in outcome})
    print("| class | " + " | ".join(kinds) + " | ratio p10/p50/p90 |")
    print("|---|" + "---|" * (len(kinds) + 1))
    for cls in classes:
        r = ratios.get(cls, [])
        cells = " | ".join(str(outcome[(cls, k)]) for k in kinds)
        print(f"| {cls} | {cells} | {pct(r, .1):.2f}/{pct(r, .5):.2f}/{pct(r, .9):.2f} (n={len(r)}) |")
    pooled = sorted(x for r in ratios.values() for x in r)
    would, refused = 0.0, Counter()
    for rid, p in plans.items():
        if p["admitted"]:
            continue
        cls = length_class(p["tokens"], p["reusable_tokens"])
        r = ratios.get(cls) if len(ratios.get(cls, [])) >= 10 else pooled
        predicted = p["t"] - p["arrived"] + p["est_ttft"]
        share = sum(predicted * x <= ttft_slo for x in r) / len(r) if r else 0.0
        would += share
        refused[p["check"]] += 1
        bucket = "pred<=3.5" if predicted <= 3.5 else "pred<=5" if predicted <= 5 else "pred>5"
        refused[bucket] += 1
    print(f"refused: {dict(refused)}; expected to have met the TTFT SLO had they been admitted "
          f"(at the admitted requests' ratio): {would:.0f}")
    margins = protected_margins(plans, records, ttft_slo)
    print(f"queue-check refusals whose protected request was found: {len(margins)}; it missed the TTFT SLO "
          f"anyway: {sum(m < 0 for m in margins)}; its margin (SLO - TTFT) p10/p50/p90 "
          f"{pct(margins, .1):.2f}/{pct(margins, .5):.2f}/{pct(margins, .9):.2f} s")


def protected_margins(plans: dict[str, dict], records: dict[int, dict], ttft_slo: float) -> list[float]:
    """SLO - client TTFT of the request each queue-check refusal protected (see the docstring)."""
    booked: dict[str, list[dict]] = defaultdict(list)
    for p in plans.values():
        if p["admitted"]:
            booked[p["prefill"]].append(p)
    margins = []
    for p in plans.values():
        if p["check"] != "queue":
            continue
        done_at, head = p["t"], None
        for e in p["entries"]:  # booking order: each predicted done once the work up to it is
            done_at += e["work"] or 0.0
            if e["slack"] is not None and p["t"] + e["slack"] >= done_at and (head is None or e["slack"] < head["slack"]):
                head = e
        if head is None or head["age"] is None:
            continue
        match = [q for q in booked[p["prefill"]] if abs(q["t"] - (p["t"] - head["age"])) < 0.01]
        c = records.get(client_id(match[0]["req"])) if len(match) == 1 else None
        if c and c.get("ttft_s"):
            margins.append(ttft_slo - c["ttft_s"])
    return margins


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(float, sys.argv[3:5]))
