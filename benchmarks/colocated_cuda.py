"""A colocated instance's step on CUDA (issue 31): decode steps with prompt chunks beside them.

A SmolLM2-135M-shaped Llama with random weights made here (a lent GPU host has no weights; see
``kv_codec_cuda.py``), bfloat16 on ``cuda``. Two parts:

* agreement: ``--seqs`` prompts served one after another (each prefilled whole, then decoded alone)
  against the same prompts through colocated steps (two decode from the start, the others'
  prompts join in chunks of the budget while they decode): greedy tokens equal, per sequence;
* cost: a decode step of ``--batch`` sequences holding ``--context`` tokens each, alone and with a
  prompt chunk of each ``--budgets`` size beside it (what a colocated step costs the tokens of the
  running batch), median of ``--reps``.

    python3 benchmarks/colocated_cuda.py [--device cuda] [--batch 32] [--context 1024]
                                         [--budgets 128 512 2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.kv_codec_cuda import random_model, sync
from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.protocol import Sampling

GREEDY = Sampling(max_tokens=24, temperature=0, ignore_eos=True)


def prompt(i: int, n: int) -> list[int]:
    return [(i * 7919 + j * 104729 + 17) % 49000 + 100 for j in range(n)]


def agreement(engine: Engine, seqs: int, budget: int) -> dict:
    prompts = [prompt(i, 100 + 150 * i) for i in range(seqs)]
    alone = []
    for i, p in enumerate(prompts):
        s = engine.add_sequence(f"alone{i}", p, GREEDY, cache_salt="alone")
        while not engine.prefill(s).done:
            pass
        while not s.finished:
            engine.decode_step([s])
        alone.append(s.tokens[len(p):])
        engine.free(s)
    mixed = [engine.add_sequence(f"mixed{i}", p, GREEDY, cache_salt="mixed") for i, p in enumerate(prompts[:2])]
    while not all(s.prefilled for s in mixed):
        engine.prefill_many([s for s in mixed if not s.prefilled])
    mixed += [engine.add_sequence(f"mixed{i}", p, GREEDY, cache_salt="mixed") for i, p in enumerate(prompts) if i >= 2]
    steps = 0
    while any(not s.finished for s in mixed):
        colocated_step(engine, [s for s in mixed if s.prefilled and not s.finished],
                       [s for s in mixed if not s.prefilled], budget)
        steps += 1
    got = [s.tokens[len(p):] for s, p in zip(mixed, prompts)]
    for s in mixed:
        engine.free(s)
    return {"sequences": seqs, "budget": budget, "steps": steps,
            "equal": sum(a == b for a, b in zip(alone, got))}


def colocated_step(engine: Engine, decoding: list, prefilling: list, budget: int) -> None:
    """One step as ``ColocatedWorker._step`` runs it: the decode batch's token, then the prompts'
    next chunks within what the batch leaves of ``budget`` (at least a block)."""
    if decoding:
        engine.decode_step(decoding)
    if prefilling:
        engine.prefill_many(prefilling, None, max(engine.block_tokens, budget - len(decoding)))


def step_cost(engine: Engine, batch: int, context: int, budgets: list[int], reps: int) -> list[dict]:
    decoding = [engine.add_sequence(f"d{i}", prompt(1000 + i, context), Sampling(max_tokens=10_000, temperature=0,
                                                                                ignore_eos=True), "cost")
                for i in range(batch)]
    for s in decoding:
        while not engine.prefill(s).done:
            pass
    rows = []
    for budget in [0, *budgets]:
        times = []
        for r in range(reps):
            chunk = [engine.add_sequence(f"c{budget}-{r}", prompt(5000 + r, max(budget, 16) + 64), GREEDY,
                                         f"cost{budget}-{r}")] if budget else []
            sync()
            t0 = time.perf_counter()
            colocated_step(engine, decoding, chunk, batch + budget)
            sync()
            times.append(time.perf_counter() - t0)
            for s in chunk:
                engine.free(s)
        rows.append({"prompt_tokens": budget, "step_ms": 1000 * statistics.median(times)})
    for s in decoding:
        engine.free(s)
    base = rows[0]["step_ms"]
    for row in rows:
        row["x_decode_alone"] = row["step_ms"] / base
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    engine = Engine(random_model(args.device), EngineConfig(kv_cache_bytes=4 << 30, prefill_chunk_tokens=2048,
                                                            max_batch=128))
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
           "agreement": [agreement(engine, args.seqs, b) for b in (64, 256)],
           "step_cost": step_cost(engine, args.batch, args.context, args.budgets, args.reps)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
