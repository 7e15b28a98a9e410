"""Where the time of a cached-prefix prefill goes: load-then-compute vs layer-wise loading (issue 12).

One engine in this process (one torch thread), one store server process (its DRAM tier holds the
prefix), the 1,792-of-2,048 case of BENCHMARKS.md §8: per rep a fresh 2,048-token prompt is
prefilled cold (chunks of 512), its 1,792-token prefix put into the store with checksums and
dropped from the engine, then the prompt is prefilled again loading the prefix from the store,
both ways, phase by phase:

- block (load-then-compute, ``kv_load = "block"``): ``get`` (shared memory, checksums verified),
  ``import_blocks`` into the pool, ``add_sequence``, the export of the prefix for decode and its
  checksums (what the worker queues before computing), then the forward of the 256 new tokens;
- layer (``kv_load = "layer"``): the stream's first layer, ``add_sequence``, then the forward, which
  waits per layer for its past (``wait`` sums those waits) while the stream lands the rest;
- pool: the same forward with the prefix already in the engine's pool (a device-cache hit: no
  loading at all), the floor of any loading scheme.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefix_load.py [--reps 5] [--dtype float32] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time

import torch

from mooncake.bench.publish import publish
from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.kv.integrity import checksums, shape_problem
from mooncake.kv.prefix_stream import PrefixStream
from mooncake.protocol import Sampling
from mooncake.testing.store_process import start_store_process
from mooncake.tiers.client import StoreClient

PROMPT, PREFIX = 2048, 1792
GREEDY = Sampling(max_tokens=2, temperature=0, ignore_eos=True)


def cold(eng: Engine, ids: list[int]) -> tuple[float, int, torch.Tensor]:
    hashes = eng.hashes(ids)
    t0 = time.perf_counter()
    seq = eng.add_sequence("cold", ids, GREEDY, hashes=hashes)
    while not (step := eng.prefill(seq)).done:
        pass
    took = time.perf_counter() - t0
    prefix = eng.kv.export_sequence(seq, 0, PREFIX // eng.block_tokens).clone()
    eng.free(seq)
    eng.blocks.forget(hashes)
    return took, step.token, prefix


async def blockwise(eng: Engine, client: StoreClient, ids: list[int]) -> tuple[dict[str, float], int]:
    hashes = eng.hashes(ids)
    t = [time.perf_counter()]
    found, blocks = await client.get(hashes[:PREFIX // eng.block_tokens])
    assert shape_problem(blocks, eng.block_shape, eng.dtype) is None
    t.append(time.perf_counter())
    eng.kv.import_blocks(found, torch.stack(blocks))
    t.append(time.perf_counter())
    seq = eng.add_sequence("block", ids, GREEDY, hashes=hashes)
    kv = eng.kv.export_sequence(seq, 0, seq.num_cached_tokens // eng.block_tokens)
    await asyncio.to_thread(checksums, kv)
    t.append(time.perf_counter())
    step = eng.prefill(seq)
    t.append(time.perf_counter())
    eng.free(seq)
    eng.blocks.forget(hashes)
    phases = dict(zip(("get", "import", "export+sums", "forward"), (b - a for a, b in zip(t, t[1:]))))
    phases["total"] = t[-1] - t[0]
    return phases, step.token


async def layerwise(eng: Engine, client: StoreClient, endpoint: str, ids: list[int]) -> tuple[dict[str, float], int]:
    hashes = eng.hashes(ids)
    asked = hashes[:PREFIX // eng.block_tokens]
    t0 = time.perf_counter()
    stream = await PrefixStream.open(endpoint, client.get_layers(asked), asked, eng.block_shape, eng.dtype)
    assert stream is not None
    t1 = time.perf_counter()
    seq = eng.add_sequence("layer", ids, GREEDY, hashes=hashes)
    seq.num_cached_tokens = seq.num_computed = stream.n * eng.block_tokens
    stream.start(lambda lo, kv: eng.kv.land_layers(seq, 0, lo, kv), stream.n, lambda layers: None,
                 eng.block_shape, eng.dtype)
    waited = [0.0]

    def wait(layer: int) -> None:
        w = time.perf_counter()
        stream.gate.wait(layer)
        waited[0] += time.perf_counter() - w

    step = await asyncio.to_thread(eng.prefill, seq, None, wait)
    t2 = time.perf_counter()
    await stream.close()
    eng.kv.adopt_prefix(seq, 0, stream.n)
    eng.free(seq)
    return {"first layer": t1 - t0, "forward": t2 - t1, "wait": waited[0], "total": t2 - t0}, step.token


def from_pool(eng: Engine, ids: list[int]) -> tuple[dict[str, float], int]:
    """The forward of the new tokens with the prefix's blocks already in the pool (as adopted by
    ``layerwise``), then the prefix is forgotten."""
    hashes = eng.hashes(ids)
    t0 = time.perf_counter()
    seq = eng.add_sequence("pool", ids, GREEDY, hashes=hashes, max_cached_blocks=PREFIX // eng.block_tokens)
    assert seq is not None and seq.num_cached_tokens == PREFIX
    step = eng.prefill(seq)
    took = time.perf_counter() - t0
    eng.free(seq)
    eng.blocks.forget(hashes)
    return {"forward": took, "total": took}, step.token


async def run(reps: int, dtype: str = "float32") -> dict[str, list[dict[str, float]]]:
    loaded = load_model(ModelConfig(device="cpu", dtype=dtype))  # type: ignore[arg-type]
    eng = Engine(loaded, EngineConfig(kv_cache_bytes=256 << 20, prefill_chunk_tokens=512, threads=1))
    proc, endpoint = start_store_process(tempfile.mkdtemp(prefix="mooncake-bench-"), "--dram-bytes", str(2 << 30),
                                         "--lmdb-bytes", "0")
    client = StoreClient(endpoint, timeout_s=30)
    out: dict[str, list[dict[str, float]]] = {"cold": [], "block": [], "layer": [], "pool": []}
    try:
        for rep in range(reps + 1):  # the first is a warm-up
            ids = [(1000 + rep * 7919 + i * 13) % 40000 + 1000 for i in range(PROMPT)]
            took, token, prefix = cold(eng, ids)
            await client.put(eng.hashes(ids)[:len(prefix)], prefix, eng.model_id, checksums(prefix))
            b, tb = await blockwise(eng, client, ids)
            la, tl = await layerwise(eng, client, endpoint, ids)
            po, tp = from_pool(eng, ids)
            assert token == tb == tl == tp, (token, tb, tl, tp)
            if rep:
                out["cold"].append({"total": took})
                out["block"].append(b)
                out["layer"].append(la)
                out["pool"].append(po)
            print(f"rep {rep}: cold {took:.3f}s block {b} layer {la} pool {po}", flush=True)
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto (the serving default)")
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = asyncio.run(run(args.reps, args.dtype))
    cold_s = statistics.median(r["total"] for r in res["cold"])
    lines = [f"| {PREFIX} of {PROMPT} tokens from the store's DRAM ({args.dtype}) | phases, median ms | total (ms) | vs cold |",
             "|---|---|---|---|", f"| cold (no prefix) | — | {cold_s * 1000:.0f} | 1.000x |"]
    for mode in ("block", "layer", "pool"):
        keys = [k for k in res[mode][0] if k != "total"]
        phases = ", ".join(f"{k} {statistics.median(r[k] for r in res[mode]) * 1000:.0f}" for k in keys)
        total = statistics.median(r["total"] for r in res[mode])
        lines.append(f"| {mode} | {phases} | {total * 1000:.0f} | {total / cold_s:.3f}x |")
    table = "\n".join(lines)
    publish(table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
