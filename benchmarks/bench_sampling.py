"""Issue 16: the cost of constrained decoding on decode throughput, and ``n=4`` against
4 separate requests.

    flock /tmp/mooncake-cpu.lock .venv/bin/python benchmarks/bench_sampling.py [--reps 5] [--out FILE]

1. Engine alone (bundled model, one torch thread): median decode-step time of a batch of
   1 and of 32 sequences (greedy, 32 steps after 2 warm-up steps per repetition), without
   and with a JSON-schema grammar (llguidance mask every step; the schema holds a string of
   at least 4000 characters, so no sequence finishes inside the measurement). Unconstrained
   and constrained repetitions alternate.
2. A dev cluster (1, then 2 prefill instances, 1 decode, no store, one torch thread each): one request with
   ``n=4`` against 4 concurrent requests with the same prompt (1024 random tokens, fresh per
   repetition, 16 output tokens, temperature 1): wall time, and prompt tokens computed
   (``prompt_tokens`` - ``prefix_cache_hits``, from /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from mooncake.api.structured import schema_grammar
from mooncake.bench.publish import publish
from mooncake.config import EngineConfig, ModelConfig, MiB
from mooncake.engine import Engine, load_model
from mooncake.protocol import Sampling
from mooncake.testing.api import MODEL, metric
from mooncake.testing.cluster import running_cluster

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}
STEPS, WARMUP = 32, 2


def step_times(eng: Engine, batch: int, grammar: str, gen: torch.Generator) -> list[float]:
    seqs = []
    for i in range(batch):
        ids = torch.randint(100, eng.vocab_size, (32,), generator=gen).tolist()
        s = eng.add_sequence(f"s{i}", ids, Sampling(max_tokens=1 << 16, temperature=0, ignore_eos=True,
                                                     grammar=grammar))
        while not s.prefilled:
            eng.prefill(s)
        seqs.append(s)
    times = []
    for k in range(WARMUP + STEPS):
        t = time.perf_counter()
        outs = eng.decode_step(seqs)
        if k >= WARMUP:
            times.append(time.perf_counter() - t)
        assert all(o.token is not None and not o.finished for o in outs)
    for s in seqs:
        eng.free(s)
    return times


def bench_grammar(reps: int) -> list[tuple[int, float, float]]:
    loaded = load_model(ModelConfig())
    eng = Engine(loaded, EngineConfig(kv_cache_bytes=512 * MiB, threads=1, max_batch=32))
    grammar = schema_grammar(SCHEMA, "response_format")
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for batch in (1, 32):
            free, constrained = [], []
            for _ in range(reps):
                free.append(statistics.median(step_times(eng, batch, "", gen)))
                constrained.append(statistics.median(step_times(eng, batch, grammar, gen)))
            rows.append((batch, statistics.median(free), statistics.median(constrained)))
    return rows


async def _n_vs_separate(url: str, reps: int, vocab: int) -> list[tuple[str, float, float]]:
    gen = torch.Generator().manual_seed(1)
    out: dict[str, list[tuple[float, float]]] = {"n=4": [], "4 requests": []}
    async with httpx.AsyncClient(timeout=600) as client:
        async def computed() -> float:
            text = (await client.get(url + "/metrics")).text
            return metric(text, "mooncake:prompt_tokens_total") - metric(text, "mooncake:prefix_cache_hits_total")

        async def one(prompt: list[int], n: int) -> None:
            r = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "n": n,
                                                                 "max_tokens": 16, "temperature": 1.0,
                                                                 "ignore_eos": True})
            r.raise_for_status()

        for rep in range(reps + 1):  # the first is a warm-up
            for kind in ("n=4", "4 requests"):
                prompt = torch.randint(100, vocab, (1024,), generator=gen).tolist()
                before = await computed()
                t = time.perf_counter()
                if kind == "n=4":
                    await one(prompt, 4)
                else:
                    await asyncio.gather(*(one(prompt, 1) for _ in range(4)))
                wall = time.perf_counter() - t
                if rep:
                    out[kind].append((wall, await computed() - before))
    return [(k, statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in out.items()]


def bench_n(reps: int, prefill: int) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory() as d, running_cluster(Path(d), prefill=prefill, decode=1, store=0,
                                                            use_store=False) as c:
        return asyncio.run(_n_vs_separate(c.url, reps, 49152))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", choices=["grammar", "n"], help="run one part only")
    args = ap.parse_args()
    lines = [] if args.only == "n" else [
        "| batch | decode step, free (ms) | with JSON-schema grammar (ms) | tokens/s free | tokens/s constrained "
        "| constrained / free throughput |", "|---:|---:|---:|---:|---:|---:|"]
    for batch, free, con in ([] if args.only == "n" else bench_grammar(args.reps)):
        lines.append(f"| {batch} | {free * 1e3:.1f} | {con * 1e3:.1f} | {batch / free:.1f} | {batch / con:.1f} | "
                     f"{free / con:.2f} |")
    if args.only != "grammar":
        lines += ["", "| prefill instances | request | wall time (s) | prompt tokens computed |", "|---:|---|---:|---:|"]
        for prefill in (1, 2):
            rows = bench_n(args.reps, prefill)
            for kind, wall, comp in rows:
                lines.append(f"| {prefill} | {kind} | {wall:.2f} | {comp:.0f} |")
            walls = {k: w for k, w, _ in rows}
            lines.append(f"| {prefill} | n=4 / 4 requests | {walls['n=4'] / walls['4 requests']:.2f} | |")
    text = "\n".join(lines)
    publish(text, args.out)


if __name__ == "__main__":
    main()
