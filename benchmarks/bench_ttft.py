"""Cached vs cold TTFT through the whole disaggregated path, and time to ready.

A 2,048-token prompt whose first 1,792 tokens are cached — in the prefill
instance's device cache, in the store's DRAM tier, in the store's LMDB tier —
against the same-length prompt cold, measured in the same run (medians of
``--reps``). Where the blocks come from is forced by sizes: a device pool that
holds about 1.5 prompts (two fresh prompts flush it), a store DRAM tier that
holds many prompts (phase 1) or about one (phase 2, so flushed blocks sit in
LMDB). Each hit's source is checked in the store's tier counters.

``--kv-load layer,block`` runs the store cases once per way of loading a prefix from the store
(``[engine] kv_load``: layer-wise just ahead of compute, or load-then-compute), each in its own
cluster with its own cold baseline; ``--threads 1`` gives every process one torch thread (issue 12); ``--dtype`` the model's dtype (float32 by default).

    .venv/bin/python benchmarks/bench_ttft.py [--reps 5] [--threads N] [--kv-load layer,block]
                                              [--where cold,device,dram,lmdb] [--dtype float32] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mooncake.bench.client import RequestRecord, stream_request
from mooncake.bench.publish import publish
from mooncake.config import MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import small_config

PROMPT, PREFIX = 2048, 1792


class Prompts:
    """Fresh token-id prompts, never repeated within a run."""

    def __init__(self) -> None:
        self.next = 1000

    def fresh(self, n: int) -> list[int]:
        ids = [(self.next + i * 7) % 40000 + 1000 for i in range(n)]
        self.next += 1
        return ids


async def ttft(url: str, prompt: list[int]) -> RequestRecord:
    rec = RequestRecord(0, "ttft", 0, 0.0)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await stream_request(client, "/v1/completions",
                             {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True}}, rec)
    if not rec.ok:
        raise RuntimeError(f"request failed: {rec.status} {rec.error}")
    return rec


def store_hits(url: str) -> dict[str, float]:
    nodes = httpx.get(url + "/cluster").json()["nodes"]
    store = next(n for n in nodes if n["role"] == "store")
    return {t: s.get("hits", 0) for t, s in store["load"].get("tiers", {}).items()}


async def scenario(url: str, prompts: Prompts, where: str, reps: int) -> tuple[list[float], list[int]]:
    times, cached = [], []
    for _ in range(reps):
        prefix = prompts.fresh(PREFIX)
        if where == "cold":
            rec = await ttft(url, prefix + prompts.fresh(PROMPT - PREFIX))
        else:
            await ttft(url, prefix + prompts.fresh(PROMPT - PREFIX))  # computes and stores the prefix
            if where != "device":
                for _ in range(2):  # flush the prefill's device cache
                    await ttft(url, prompts.fresh(PROMPT))
                await asyncio.sleep(2.5)  # heartbeats carry the store's tier counters
            before = store_hits(url)
            rec = await ttft(url, prefix + prompts.fresh(PROMPT - PREFIX))
            if where != "device":
                await asyncio.sleep(2.5)
                after = store_hits(url)
                assert after.get(where, 0) > before.get(where, 0), f"expected a {where} hit: {before} -> {after}"
        times.append(rec.ttft_s)
        cached.append(rec.cached_tokens or 0)
    return times, cached


def start(dram_bytes: int, threads: int = 0, kv_load: str = "layer", dtype: str = "float32") -> tuple[LocalCluster, float]:
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-bench-")))
    cfg.model.dtype = dtype  # type: ignore[assignment]
    half = 1 if dtype == "float32" else 2  # 16-bit KV takes half the bytes: the same sizes in prompts
    cfg.engine.kv_cache_bytes = 140 * MiB // half  # ~1.5 prompts of 2,048 tokens (46 KiB per token in float32)
    cfg.engine.threads = threads
    cfg.engine.kv_load = kv_load  # type: ignore[assignment]
    cfg.store.dram_bytes = dram_bytes // half
    cfg.store.lmdb_bytes = 4096 * MiB
    cluster = LocalCluster(cfg)
    t0 = time.perf_counter()
    cluster.start()
    return cluster, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    ap.add_argument("--kv-load", default="layer", help="comma-separated: layer, block ([engine] kv_load)")
    ap.add_argument("--where", default="cold,device,dram,lmdb", help="comma-separated cases")
    ap.add_argument("--dtype", default="float32", help="[model] dtype: float32, bfloat16 or auto")
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    wanted = args.where.split(",")
    rows: list[tuple[str, str, list[float], list[int], float]] = []  # load, where, times, cached, cold median
    prompts = Prompts()
    ready_s = 0.0
    for load in args.kv_load.split(","):
        results: dict[str, tuple[list[float], list[int]]] = {}
        first = [w for w in ("cold", "device", "dram") if w in wanted]
        if first:
            cluster, ready_s = start(2048 * MiB, args.threads, load, args.dtype)
            try:
                asyncio.run(ttft(cluster.url, prompts.fresh(64)))  # warm-up
                for where in first:
                    results[where] = asyncio.run(scenario(cluster.url, prompts, where, args.reps))
            finally:
                cluster.stop()
        if "lmdb" in wanted:
            cluster, _ = start(110 * MiB, args.threads, load, args.dtype)  # about one prompt: flushed blocks land in LMDB
            try:
                asyncio.run(ttft(cluster.url, prompts.fresh(64)))
                results["lmdb"] = asyncio.run(scenario(cluster.url, prompts, "lmdb", args.reps))
            finally:
                cluster.stop()
        cold = statistics.median(results["cold"][0]) if "cold" in results else float("nan")
        rows += [(load, where, times, cached, cold) for where, (times, cached) in results.items()]

    lines = [f"Time from `mooncake serve --dev` start to ready (model already converted): {ready_s:.1f} s", "",
             f"| {PREFIX}/{PROMPT} tokens cached in | kv_load | median TTFT (ms) | vs cold (same cluster) "
             "| per rep (ms) | cached tokens (median) |", "|---|---|---|---|---|---|"]
    for load, where, times, cached, cold in rows:
        med = statistics.median(times)
        reps = ", ".join(f"{t * 1000:.0f}" for t in times)
        lines.append(f"| {where} | {load} | {med * 1000:.0f} | {med / cold:.3f}x | {reps} "
                     f"| {statistics.median(cached):.0f} |")
    table = "\n".join(lines)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
