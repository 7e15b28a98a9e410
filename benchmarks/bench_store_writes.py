"""What the store costs when nothing is reused, and what reuse-aware writes save (issue 33), through
the served path.

Clusters as ``bench_e2e.py`` starts mooncake (2 prefill, 1 decode, 1 store, 400 MiB KV
pools): ``reused`` (the default ``[conductor] store_writes``), ``all`` (every block written, as
before), and ``no_store`` (``use_store = false``; the device prefix caches on). Two replays each,
of ``bench_e2e.py``'s trace workload (the shared trace's 3 largest prefix groups, 69 requests,
blocks of 16 tokens, prompts up to 1,500 tokens, 32 out) at ``--rate-scale``: as it is, and with
every prefix made unique (``TraceScaling.unique_prefixes``: the same lengths and arrivals, no block
shared), each on a cluster of its own. Per replay: goodput (TTFT <= 3 s, TPOT <= 300 ms), prefix hit rate, and the blocks the
store took against the prompt blocks computed (the conductor's prompt tokens less its cache hits).

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_store_writes.py \
        [--rate-scale 2] [--systems reused all no_store] [--replays "as is" "unique prefixes"] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from benchmarks.bench_e2e import SLOS, start_local, warm, workloads
from mooncake.bench import BenchConfig, run_benchmark
from mooncake.config import MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import metric, metrics
from mooncake.testing.cluster import small_config
from mooncake.tiers.client import StoreClient

SYSTEMS = ["reused", "all", "no_store"]
REPLAYS = {"as is": False, "unique prefixes": True}  # name -> every prefix made unique


def start(system: str) -> LocalCluster:
    cfg = small_config(Path(tempfile.mkdtemp(prefix="bench-store-writes-")))
    cfg.model.dtype = "auto"  # as mooncake serve
    cfg.engine.kv_cache_bytes = 400 * MiB
    if system == "no_store":
        cfg.conductor.use_store = False
    else:
        cfg.conductor.store_writes = system
    return start_local(cfg)


async def stored_blocks(url: str) -> int:
    """Blocks the cluster's stores took since they started."""
    nodes = httpx.get(url + "/cluster", timeout=30).json()["nodes"]
    total = 0
    for n in nodes:
        if n["role"] == "store":
            c = StoreClient(n["endpoints"]["store"])
            try:
                total += (await c.stats())["stored"]
            finally:
                c.close()
    return total


def computed_blocks(url: str) -> float:
    m = metrics(url)
    return (metric(m, "mooncake:prompt_tokens_total") - metric(m, "mooncake:prefix_cache_hits_total")) / 16


def replay(system: str, url: str, name: str, kw: dict) -> dict:
    before = (asyncio.run(stored_blocks(url)), computed_blocks(url))
    cfg = BenchConfig(goodput_slos_ms=SLOS, label=f"{system}/{name}", progress=False, timeout_s=300,
                      base_url=url, ignore_eos=True, **kw)
    t0 = time.perf_counter()
    s = asyncio.run(run_benchmark(cfg)).summary
    stored, computed = asyncio.run(stored_blocks(url)) - before[0], computed_blocks(url) - before[1]
    row = {"system": system, "replay": name, "ok": f"{s['completed']}/{s['requests']}", "goodput": s["goodput"],
           "hit": s["prefix_hit_rate"], "stored": stored, "computed": computed,
           "ttft_p50_ms": s["ttft_ms"]["median"]}
    print(f"[{system}/{name}] {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate-scale", type=float, default=2.0)
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--replays", nargs="+", default=list(REPLAYS), choices=list(REPLAYS))
    ap.add_argument("--rounds", type=int, default=1, help="run every system's replays this many times, in turn")
    args = ap.parse_args()
    rows = []
    for system in [s for _ in range(args.rounds) for s in args.systems]:
        for name in args.replays:
            unique = REPLAYS[name]
            cluster = start(system)  # a cluster of its own: a workload from its start
            try:
                asyncio.run(warm(cluster.url, None, False))
                kw = workloads(False, "", args.rate_scale, salt=1)["trace"]
                kw["scaling"] = replace(kw["scaling"], unique_prefixes=unique)
                rows.append(replay(system, cluster.url, name, kw))
            finally:
                cluster.stop()
    print(f"\nrate scale {args.rate_scale:g}\n")
    print("| replay | system | ok | goodput req/s | prefix hit rate | store blocks written / prompt blocks computed | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["replay"]):
        share = r["stored"] / r["computed"] if r["computed"] else 0.0
        print(f"| {r['replay']} | {r['system']} | {r['ok']} | {r['goodput']:.3f} | {r['hit']} | "
              f"{r['stored']} / {r['computed']:.0f} ({share:.0%}) | {r['ttft_p50_ms']} |")


if __name__ == "__main__":
    main()
