"""Why a replay's requests missed the SLO, and whether its queue kept growing, from the JSON
reports ``mooncake bench`` / ``bench_e2e.py`` write.

    .venv/bin/python benchmarks/slo_misses.py [--ttft-ms 3000] [--tpot-ms 300] REPORT.json [...]

Prints one markdown row per report: requests in SLO, the misses by cause (failed or rejected,
TTFT only, TPOT only, both), and TTFT p50 of the first and the last quarter of the requests
by send time: on a sustained replay a last quarter far above the first is a queue that grows
(arrivals above what the system serves), where a burst absorbed within the SLO looks flat.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median


def tpot_s(r: dict) -> float:
    """(e2e - ttft) / (tokens - 1), 0 with fewer than 2 tokens (as the benchmark's SLO check)."""
    n = r.get("completion_tokens") or 0
    return (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n >= 2 else 0.0


def row(path: Path, ttft_ms: float, tpot_ms: float) -> str:
    report = json.loads(path.read_text())
    records = sorted(report["records"], key=lambda r: r["start_s"])
    failed = ttft = tpot = both = good = 0
    for r in records:
        if not r["ok"] or r.get("ttft_s") is None or r.get("e2e_s") is None:
            failed += 1
            continue
        slow_first, slow_rest = r["ttft_s"] * 1e3 > ttft_ms, tpot_s(r) * 1e3 > tpot_ms
        both += slow_first and slow_rest
        ttft += slow_first and not slow_rest
        tpot += slow_rest and not slow_first
        good += not (slow_first or slow_rest)
    quarter = max(1, len(records) // 4)

    def ttft_p50(part: list[dict]) -> str:
        values = [r["ttft_s"] * 1e3 for r in part if r["ok"] and r.get("ttft_s") is not None]
        return f"{median(values):.0f}" if values else "-"

    name = f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem
    return (f"| {name} | {good} / {len(records)} | {failed} | {ttft} | {tpot} | {both} | "
            f"{ttft_p50(records[:quarter])} / {ttft_p50(records[-quarter:])} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--ttft-ms", type=float, default=3000.0)
    ap.add_argument("--tpot-ms", type=float, default=300.0)
    args = ap.parse_args()
    print("| report | in SLO / requests | failed or 429 | TTFT only | TPOT only | both | "
          "TTFT p50 first / last quarter (ms) |")
    print("|---|---|---|---|---|---|---|")
    for path in args.reports:
        print(row(path, args.ttft_ms, args.tpot_ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
