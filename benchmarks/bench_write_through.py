"""The cost of ``[store] ssd_admission = "write_through"`` on store put throughput, against
``on_demotion``, in the same run. Blocks are the bundled model's KV blocks (SmolLM2-135M,
float32, 16 tokens: 720 KiB); GB/s = 1e9 B/s, medians of repeated runs, each on a fresh store.

- in-process, fits in DRAM: puts into a TieredStore whose DRAM holds everything. on_demotion
  writes nothing to disk; write_through puts while its writer thread copies to LMDB; "durable"
  times until the last copy is on disk.
- in-process, DRAM full (steady state): DRAM holds a quarter of the data, so most puts demote
  an older block to LMDB. on_demotion writes it in the put; write_through adopts the copy its
  writer already made.
- remote: a store server process (``python -m mooncake.tiers.server``) per mode, puts over
  ZeroMQ from another process in requests of 8 MiB, as workers write back.

    .venv/bin/python benchmarks/bench_write_through.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time

import torch

from mooncake.bench.publish import publish
from mooncake.kv.integrity import checksums
from mooncake.testing.store_process import start_store_process
from mooncake.tiers.client import StoreClient
from mooncake.tiers.memory import DramTier
from mooncake.tiers.lmdb_tier import LmdbTier
from mooncake.tiers.tiered import TieredStore

MiB, GiB = 1 << 20, 1 << 30
BLOCK_SHAPE = (30, 2, 3, 16, 64)  # layers, K/V, kv heads, block tokens, head dim: 737,280 bytes in float32
MODES = ("on_demotion", "write_through")


def key(run: int, i: int) -> bytes:
    return (run * 1_000_003 + i).to_bytes(8, "little") * 4


def in_process(blocks: list[torch.Tensor], dram_bytes: int, mode: str, run: int) -> tuple[float, float]:
    """(put GB/s, durable GB/s: until every write-through copy is on disk; = put for on_demotion)."""
    total = sum(b.nbytes for b in blocks)
    with tempfile.TemporaryDirectory(prefix="bench-wt-") as tmp:
        store = TieredStore([DramTier(dram_bytes), LmdbTier(tmp, 2 * total)], ssd_admission=mode)
        keys = [key(run, i) for i in range(len(blocks))]
        t0 = time.perf_counter()
        for i in range(0, len(blocks), 8):  # requests of 8 blocks, as a worker's write-back
            store.put_many(keys[i:i + 8], blocks[i:i + 8])
        put_s = time.perf_counter() - t0
        if store.writer is not None:
            store.writer.wait_idle()
        durable_s = time.perf_counter() - t0
        store.close()
    return total / put_s / 1e9, total / durable_s / 1e9


def start_server(data_dir: str, mode: str, dram_bytes: int) -> tuple[subprocess.Popen, str]:
    return start_store_process(data_dir, "--node-id", mode, "--dram-bytes", str(dram_bytes),
                               "--lmdb-bytes", str(4 * GiB), "--ssd-admission", mode)


async def remote(endpoint: str, blocks: list[torch.Tensor], run: int) -> tuple[float, float]:
    client = StoreClient(endpoint, timeout_s=120, shm=False)
    total = sum(b.nbytes for b in blocks)
    keys = [key(run, i) for i in range(len(blocks))]
    per = max(1, 8 * MiB // blocks[0].nbytes)
    sums = checksums(blocks)  # a store refuses puts without them (computed by the writer, not timed here)
    try:
        t0 = time.perf_counter()
        for i in range(0, len(blocks), per):
            await client.put(keys[i:i + per], blocks[i:i + per], checksums=sums[i:i + per])
        put_s = time.perf_counter() - t0
        while True:
            wt = (await client.stats()).get("write_through")
            if wt is None or wt["queued"] == 0:
                break
            await asyncio.sleep(0.005)
        return total / put_s / 1e9, total / (time.perf_counter() - t0) / 1e9
    finally:
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="less data, fewer repetitions")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    total = 64 * MiB if args.quick else 256 * MiB
    reps = 3 if args.quick else 7
    one = torch.randn(BLOCK_SHAPE)
    blocks = [one.clone() + i for i in range(total // one.nbytes)]
    total = sum(b.nbytes for b in blocks)
    rows: dict[str, dict[str, float]] = {}
    for name, dram in (("in-process, fits in DRAM", 2 * total), ("in-process, DRAM full", total // 4)):
        for mode in MODES:
            runs = [in_process(blocks, dram, mode, r) for r in range(reps)]
            rows.setdefault(f"{name}: put", {})[mode] = statistics.median(p for p, _ in runs)
            rows.setdefault(f"{name}: durable", {})[mode] = statistics.median(d for _, d in runs)
            print(name, mode, runs, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-wt-srv-") as tmp:
        for mode in MODES:
            proc, ep = start_server(tmp, mode, 2 * total * (reps + 1))
            try:
                asyncio.run(remote(ep, blocks, 10_000))  # warm-up: connection, allocator
                runs = [asyncio.run(remote(ep, blocks, r)) for r in range(reps)]
            finally:
                proc.terminate()
                proc.wait(60)
            rows.setdefault("remote over ZeroMQ: put", {})[mode] = statistics.median(p for p, _ in runs)
            rows.setdefault("remote over ZeroMQ: durable", {})[mode] = statistics.median(d for _, d in runs)
            print("remote", mode, runs, flush=True)
    lines = [f"Store puts, GB/s (1e9 B/s), median of {reps} runs of {total / MiB:.0f} MiB in "
             f"{len(blocks)} blocks of {one.nbytes} bytes; one torch thread.", "",
             "| measure | on_demotion | write_through | write_through / on_demotion |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['on_demotion']:.2f} | {r['write_through']:.2f} | "
                     f"{r['write_through'] / r['on_demotion']:.2f} |")
    table = "\n".join(lines)
    publish(table, args.out)


if __name__ == "__main__":
    main()
