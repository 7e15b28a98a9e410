"""Where a replay's inter-token latency tail lies: the first gap (first token -> second token,
which on mooncake spans the hand-over of the KV from prefill to decode) against the later
gaps (decode steps), from the JSON reports ``mooncake bench`` / ``bench_e2e.py`` write.

    .venv/bin/python benchmarks/itl_breakdown.py REPORT.json [REPORT.json ...]

Prints one markdown row per report: requests in SLO, goodput, TTFT and ITL p50/p99, the first
gap's p50/p99 and the later gaps' p99, and how many gaps over 300 ms were first gaps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in [0, 1]) in ms; 0 for no values."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3


def breakdown(path: Path) -> str:
    report = json.loads(path.read_text())
    s, records = report["summary"], [r for r in report["records"] if r["ok"]]
    first = [r["itl_s"][0] for r in records if r["itl_s"]]
    later = [x for r in records for x in r["itl_s"][1:]]
    slow_first = sum(1 for x in first if x > 0.3)
    slow = slow_first + sum(1 for x in later if x > 0.3)
    name = f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem
    return (f"| {name} | {s['good_requests']} / {s['requests']} | {s['goodput']:.3f} | "
            f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | {s['itl_ms']['median']:.0f} / "
            f"{s['itl_ms']['p99']:.0f} | {pct(first, .5):.0f} / {pct(first, .99):.0f} | {pct(later, .99):.0f} | "
            f"{slow_first} of {slow} |")


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    print("| report | in SLO / requests | goodput (req/s) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
          "first gap p50 / p99 (ms) | later gaps p99 (ms) | gaps > 300 ms: first of all |")
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        print(breakdown(Path(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
