"""The leading conductor's CPU per request in a live cluster of roles started alone (issue 29).

A dev cluster of separate processes, as an operator runs them: one conductor (no frontend of its
own), ``--frontends`` frontends, a store, a prefill and a decode on the bundled model (float32,
one torch thread each). After a warm-up, ``--requests`` greedy streamed completions of
``--max-tokens`` tokens are sent through the frontends in turn, ``--concurrency`` at a time, with
prompts that share a 256-token prefix (the cache and the index at work). The conductor's CPU (its
threads' ``/proc/PID/task/*/schedstat``, to the nanosecond: ``/proc/PID/stat`` counts 10 ms ticks,
0.4 ms a request over 24) is read over the whole window, heartbeats and every other background
task included, and divided by the requests completed; the same for the frontends. A second pass
with 4× the output tokens shows whether the conductor's cost grows with output length (it should
not: decode streams tokens to the frontends). Before the load the conductor's CPU is read over
``--idle-s`` with no request (heartbeats, liveness checks): its background rate, which the last
column takes out of the per-request figure (a cluster at a higher rate spreads it thinner).

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_live_conductor.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import small_config
from mooncake.testing.ports import free_port


def cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads so far, to the nanosecond (the conductor's threads
    live as long as it does; a thread that ended is missing)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return total / 1e9


async def load(urls: list[str], n: int, concurrency: int, max_tokens: int, seed: int) -> int:
    """``n`` greedy completions over the frontends in turn; how many came back whole."""
    prefix = [(7919 * i) % 30000 + 1000 for i in range(256)]
    ok = 0
    queue = list(range(n))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal ok
        while queue:
            i = queue.pop()
            prompt = prefix + [(seed * 104729 + i * 31 + k) % 30000 + 1000 for k in range(64)]
            r = await http.post(urls[i % len(urls)] + "/v1/completions",
                                json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                      "ignore_eos": True})
            ok += r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontends", type=int, default=2, help="frontend processes (at least 2)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--idle-s", type=float, default=15.0, help="seconds the idle conductor's CPU is read over")
    args = ap.parse_args()
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-live-conductor-")))
    frontends = max(2, args.frontends)  # one would run in the conductor's process
    cfg.frontend.port = free_port(consecutive=frontends)
    cluster = LocalCluster(cfg, 1, 1, 1, frontends=frontends)
    cluster.start(timeout_s=300)
    try:
        pid = cluster.children["conductor"].pid
        fronts = [cluster.children[f"frontend{i}"].pid for i in range(len(cluster.urls))]
        asyncio.run(load(cluster.urls, 8, 4, 4, seed=0))  # warm-up
        time.sleep(2)
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(args.idle_s)
        idle = (cpu_s(pid) - c0) / (time.monotonic() - t0)  # CPU seconds per second with no request
        print(f"idle conductor: {1000 * idle:.2f} ms of CPU per second ({100 * idle:.2f}% of a core)\n")
        print("| output tokens | requests ok | wall s | conductor CPU ms/request | conductor core "
              "| frontend CPU ms/request (each) | conductor ms/request above idle |\n|---|---|---|---|---|---|---|")
        for tokens in (args.max_tokens, 4 * args.max_tokens):
            time.sleep(2)
            c0, f0, t0 = cpu_s(pid), [cpu_s(p) for p in fronts], time.monotonic()
            ok = asyncio.run(load(cluster.urls, args.requests, args.concurrency, tokens, seed=tokens))
            wall = time.monotonic() - t0
            c, f = cpu_s(pid) - c0, [cpu_s(p) - b for p, b in zip(fronts, f0)]
            print(f"| {tokens} | {ok}/{args.requests} | {wall:.1f} | {1000 * c / max(1, ok):.2f} | {100 * c / wall:.1f}% "
                  f"| {' / '.join(f'{1000 * x / max(1, ok / len(fronts)):.1f}' for x in f)} "
                  f"| {1000 * max(0.0, c - idle * wall) / max(1, ok):.2f} |", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
