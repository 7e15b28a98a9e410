"""What ``make bench`` runs: every benchmark script in turn, quick settings.

Each script is run with ``--quick`` when its ``--help`` lists that flag
(``bench_ttft.py`` has ``--reps`` instead: it gets ``--reps 2``); its output is
printed as it comes. A script that is not in the tree is reported as skipped.
Exit status: non-zero when any script failed.

    .venv/bin/python benchmarks/run_all.py [--full] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["bench_engine.py", "bench_dtype.py", "bench_families.py", "bench_store.py", "bench_ttft.py", "bench_scheduler.py",
           "bench_conductor.py", "bench_cost_model.py", "bench_sim.py", "bench_e2e.py"]


def quick_flags(script: Path) -> list[str]:
    try:
        text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                              timeout=120).stdout
    except subprocess.TimeoutExpired:
        text = ""
    if "--quick" in text:
        return ["--quick"]
    if "--reps" in text:
        return ["--reps", "2"]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="run each script with its default (full) settings")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these scripts (e.g. bench_store.py)")
    args = ap.parse_args()
    names = args.only or SCRIPTS
    results: list[tuple[str, str, float]] = []
    for name in names:
        script = HERE / name
        if not script.exists():
            print(f"=== {name}: not present, skipped", flush=True)
            results.append((name, "skipped", 0.0))
            continue
        cmd = [sys.executable, str(script)] + ([] if args.full else quick_flags(script))
        print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=HERE.parent)  # output goes straight through
        dt = time.perf_counter() - t0
        results.append((name, "ok" if rc == 0 else f"FAILED (exit {rc})", dt))
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {dt:.0f} s", flush=True)
    print("\n| benchmark | result | time (s) |\n|---|---|---|")
    for name, res, dt in results:
        print(f"| {name} | {res} | {dt:.0f} |")
    return 1 if any(r.startswith("FAILED") for _, r, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
