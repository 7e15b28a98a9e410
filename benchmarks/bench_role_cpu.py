"""Where a long prompt's CPU time goes, per role process and thread (issue 12, third pass).

One dev cluster (``--stages`` prefill instances with ``cpp_group_size`` = stages, 1 decode, 1 store,
one torch thread per process, 512 MiB KV pools, float32), a short warm-up, then ``--reps`` fresh
``--tokens``-token prompts one at a time; for each, the CPU seconds every role process and its
busiest threads used while it ran (``/proc/PID/task/TID/stat``: user + system), beside its TTFT.
On a machine with as many cores as compute processes, whatever the other processes use is taken
from the stages' compute.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_role_cpu.py [--stages 2] [--reps 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

from mooncake.config import MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import small_config

from one_request import fresh_prompt, stream_one


def stat_cpu_s(path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a ``/proc/PID/stat`` or ``/proc/PID/task/TID/stat`` file."""
    with open(path) as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of ``pid`` (``name:tid``)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, seconds = stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[f"{name}:{tid}"] = seconds
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-bench-cpu-")), cpp_group_size=args.stages)
    cfg.engine.kv_cache_bytes = 512 * MiB
    cfg.store.dram_bytes = 1024 * MiB
    cluster = LocalCluster(cfg, prefill=args.stages)
    cluster.start(timeout_s=300)
    try:
        asyncio.run(stream_one(cluster.url, MODEL, fresh_prompt(999, 64), 2, "cpu"))
        for rep in range(args.reps):
            before = {name: thread_cpu_s(p.pid) for name, p in cluster.children.items()}
            t0 = time.perf_counter()
            rec = asyncio.run(stream_one(cluster.url, MODEL, fresh_prompt(rep, args.tokens), 4, "cpu"))
            wall = time.perf_counter() - t0
            print(f"{args.stages} stage(s), rep {rep}: TTFT {rec.ttft_s:.2f} s, request {wall:.2f} s")
            for name, p in cluster.children.items():
                after = thread_cpu_s(p.pid)
                used = {t: s - before[name].get(t, 0.0) for t, s in after.items()}
                top = sorted(used.items(), key=lambda kv: -kv[1])[:3]
                print(f"  {name}: {sum(used.values()):.2f} s CPU ("
                      + ", ".join(f"{t} {s:.2f}" for t, s in top if s >= 0.01) + ")")
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
