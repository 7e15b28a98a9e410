"""Store throughput: raw memcpy and raw LMDB beside the tiers in-process and the store server
from another process (socket and shared-memory paths). Medians of repeated runs, GB/s (1e9 B/s).

    .venv/bin/python benchmarks/bench_store.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from typing import Callable

import lmdb
import torch

from mooncake.bench.publish import publish
from mooncake.kv.integrity import checksums
from mooncake.testing.store_process import start_store_process
from mooncake.tiers.base import StoredBlock
from mooncake.tiers.client import StoreClient
from mooncake.tiers.memory import DeviceTier, DramTier
from mooncake.tiers.lmdb_tier import LmdbTier

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def blocks_for(size: int, total: int) -> list[torch.Tensor]:
    n = max(2, total // size)
    return [torch.randn(size // 4) for _ in range(n)]


def median_gbps(fn: Callable[[], int], reps: int) -> float:
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        nbytes = fn()
        rates.append(nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little", signed=True) * 4


def bench_memcpy(blocks, reps):
    dst = [torch.empty_like(b) for b in blocks]

    def run():
        for d, b in zip(dst, blocks):
            d.copy_(b)
        return sum(b.nbytes for b in blocks)
    return median_gbps(run, reps)


def bench_alloc_layout(blocks, reps, recycle):
    tier = DramTier(4 * sum(b.nbytes for b in blocks), recycle=recycle)
    state = {"i": 0}

    def run():  # steady state: every put replaces (frees) an older block, as under eviction
        for b in blocks:
            tier.delete(key(state["i"] - len(blocks)))
            tier.put(key(state["i"]), StoredBlock(b))
            state["i"] += 1
        return sum(b.nbytes for b in blocks)
    run()
    return median_gbps(run, reps)


def bench_tier(tier, blocks, reps):
    keys = [key(i) for i in range(len(blocks))]
    total = sum(b.nbytes for b in blocks)
    flush = getattr(tier, "flush", lambda: [])

    def put():
        for k, b in zip(keys, blocks):
            tier.put(k, StoredBlock(b))
        flush()
        return total

    dst = [torch.empty_like(b) for b in blocks]

    def get():  # into the consumer's buffer (e.g. a KV pool), as a transfer would; per key, as the store reads
        for d, k in zip(dst, keys):
            d.copy_(tier.get(k).tensor)
        return total
    p = median_gbps(put, reps)
    g = median_gbps(get, reps)
    return p, g


def bench_raw_lmdb(blocks, reps, path):
    env = lmdb.open(path, map_size=4 * sum(b.nbytes for b in blocks) + 64 * MiB, sync=False, metasync=False)
    keys = [key(i) for i in range(len(blocks))]
    raws = [memoryview(b.numpy()).cast("B") for b in blocks]
    total = sum(b.nbytes for b in blocks)

    def put():
        with env.begin(write=True) as txn:
            for k, r in zip(keys, raws):
                txn.put(k, r)
        return total

    dst = [torch.empty(b.nbytes, dtype=torch.uint8) for b in blocks]

    def get():
        with env.begin(buffers=True) as txn:
            for k, d in zip(keys, dst):
                d.copy_(torch.frombuffer(txn.get(k), dtype=torch.uint8))
        return total
    import warnings
    warnings.simplefilter("ignore", UserWarning)
    p = median_gbps(put, reps)
    g = median_gbps(get, reps)
    env.close()
    return p, g


def start_server(data_dir: str) -> tuple[subprocess.Popen, str]:
    return start_store_process(data_dir, "--dram-bytes", str(3 * GiB), "--lmdb-bytes", "0")


async def bench_remote(endpoint, blocks, reps, shm, per_request):
    client = StoreClient(endpoint, timeout_s=60, shm=shm, shm_min_bytes=0)
    keys = [key(i + (1 << 40) * shm) for i in range(len(blocks))]
    total = sum(b.nbytes for b in blocks)
    sums = checksums(blocks)  # a store refuses puts without them (computed by the writer, not timed here)
    chunks = [(keys[i:i + per_request], blocks[i:i + per_request], sums[i:i + per_request])
              for i in range(0, len(blocks), per_request)]

    async def put():
        for ks, bs, ss in chunks:
            await client.put(ks, bs, checksums=ss)
        return total

    async def get():
        for ks, _, _ in chunks:
            await client.get(ks)
        return total

    async def med(fn):
        rates = []
        await fn()  # warm-up: connections, segments
        for _ in range(reps):
            t = time.perf_counter()
            n = await fn()
            rates.append(n / (time.perf_counter() - t) / 1e9)
        return statistics.median(rates)
    try:
        return await med(put), await med(get)
    finally:
        client.close()


MODEL_BLOCK = (30, 2, 16, 3, 64)  # the served model's KV block: 368,640 bytes in float16
MODEL_BATCH = 32  # blocks a put carries (a write-back's [32, ...] tensor), a get asks for


def bench_model_block(endpoint: str, reps: int = 5) -> dict[str, float]:
    """Puts and gets of the served model's KV blocks, 32 a request, over ZeroMQ TCP and shared
    memory in the same run (median of ``reps`` each): GB/s."""
    kvs = [torch.randn(MODEL_BATCH, *MODEL_BLOCK).half() for _ in range(8)]  # ~94 MB a pass
    out: dict[str, float] = {}
    for shm in (False, True):
        name = "shm" if shm else "socket"
        blocks = [b for kv in kvs for b in kv.unbind(0)]
        out[f"{name} put"], out[f"{name} get"] = asyncio.run(
            bench_remote(endpoint, blocks, reps, shm, MODEL_BATCH))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller data, fewer repetitions")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    torch.set_num_threads(1)  # shared 2-core machine: OpenMP spinning across busy cores only adds noise
    total = 32 * MiB if args.quick else 128 * MiB
    reps = 3 if args.quick else 7
    sizes = [256 * KiB, 1 * MiB, 8 * MiB]
    rows = []
    tmp = tempfile.mkdtemp(prefix="bench-store-")
    proc, endpoint = start_server(tmp)
    try:
        for size in sizes:
            blocks = blocks_for(size, total)
            tot = sum(b.nbytes for b in blocks)
            r = {"size": f"{size // KiB} KiB"}
            r["memcpy"] = bench_memcpy(blocks, reps)
            r["dram fresh alloc put"] = bench_alloc_layout(blocks, reps, recycle=False)
            r["dram recycled put"] = bench_alloc_layout(blocks, reps, recycle=True)
            r["device put"], r["device get"] = bench_tier(DeviceTier(2 * tot), blocks, reps)
            r["dram put"], r["dram get"] = bench_tier(DramTier(2 * tot), blocks, reps)
            lt = LmdbTier(os.path.join(tmp, f"lmdb-{size}"), 2 * tot)
            r["lmdb put"], r["lmdb get"] = bench_tier(lt, blocks, reps)
            lt.close()
            r["raw lmdb put"], r["raw lmdb get"] = bench_raw_lmdb(blocks, reps, os.path.join(tmp, f"raw-{size}"))
            per_req = max(1, (8 * MiB) // size)
            for shm in (False, True):
                name = "shm" if shm else "socket"
                r[f"{name} put"], r[f"{name} get"] = asyncio.run(bench_remote(endpoint, blocks, reps, shm, per_req))
            rows.append(r)
            print(r, flush=True)
        model = bench_model_block(endpoint)
        print(model, flush=True)
    finally:
        proc.terminate()
        proc.wait(10)
    cols = [c for c in rows[0] if c != "size"]
    lines = [f"Block bytes moved per second, GB/s (1e9), median of {reps} runs over {total // MiB} MiB "
             f"per size; remote = store server in another process on tcp://127.0.0.1, "
             f"requests of 8 MiB.", "",
             "| measure | " + " | ".join(r["size"] for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for c in cols:
        lines.append(f"| {c} | " + " | ".join(f"{r[c]:.2f}" for r in rows) + " |")
    lines += ["", f"The served model's KV block ({MODEL_BLOCK} float16, 368,640 bytes), {MODEL_BATCH} a request, "
              "median of 5, GB/s:", "", "| path | put | get |", "|---|---:|---:|"]
    for name, label in (("socket", "ZeroMQ TCP"), ("shm", "shared memory")):
        lines.append(f"| {label} | {model[name + ' put']:.2f} | {model[name + ' get']:.2f} |")
    table = "\n".join(lines)
    publish(table, args.out)


if __name__ == "__main__":
    main()
