"""Prefill cost model: predicted vs realized prefill time on the real engine.

    .venv/bin/python benchmarks/bench_cost_model.py [--quick] [--threads N] [--requests N] [--out FILE]

Profiles the engine at start-up (``mooncake.engine.profile``: prefill part and decode part
timed separately), then runs a seeded spread of real prefills (log-uniform 8–1,500 new
tokens; a third extend an earlier prompt, so part of them is in the prefix cache) and, for
each, compares the realized compute time (the prefill role's ``prefill_s``: the chunk loop)
with what four models predicted *before* seeing it:

- default prior, frozen / with online fitting (what the conductor has without a profile),
- profile-seeded prior, frozen / with online fitting (``PrefillCostModel.from_profile``).

Online models observe each request after predicting it (one-step-ahead, out of sample).
Reported: median and p90 of ``|predicted - actual| / actual`` and the median of
``predicted / actual`` (bias), over all requests and over the second half (after the online
models have seen the first half).
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import time

import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.profile import profile_engine
from mooncake.protocol import Sampling
from mooncake.sched.cost_model import PrefillCostModel
from mooncake.bench.publish import publish

GREEDY = Sampling(max_tokens=1, temperature=0.0)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def workload(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of log-uniform length 8–1,500; a third extend an earlier prompt by that length."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for i in range(n):
        new = int(math.exp(rng.uniform(math.log(8), math.log(1500))))
        fresh = [rng.randrange(100, vocab) for _ in range(new)]
        if prompts and i % 3 == 2:
            base = rng.choice(prompts)
            prompts.append((base + fresh)[:1900])
        else:
            prompts.append(fresh)
    return prompts


def run_prefill(engine: Engine, tokens: list[int], rid: str) -> tuple[int, int, float]:
    seq = engine.add_sequence(rid, tokens, GREEDY)
    assert seq is not None, "KV pool too small for the workload"
    try:
        t0 = time.perf_counter()
        while not engine.prefill(seq).done:
            pass
        return len(tokens) - seq.num_cached_tokens, seq.num_cached_tokens, time.perf_counter() - t0
    finally:
        engine.free(seq)


def summarize(errors: dict[str, list[tuple[float, float]]], half: int) -> list[str]:
    rows = ["| model | median rel. error | p90 rel. error | median pred/actual | 2nd half: median | 2nd half: p90 |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, pairs in errors.items():
        rel = [abs(p - a) / a for p, a in pairs]
        late = rel[half:]
        ratio = statistics.median(p / a for p, a in pairs)
        rows.append(f"| {name} | {statistics.median(rel):.0%} | {pct(rel, 90):.0%} | {ratio:.2f} | "
                    f"{statistics.median(late):.0%} | {pct(late, 90):.0%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="12 requests")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="also write the report (markdown) here")
    args = ap.parse_args()
    n_req = 12 if args.quick else args.requests

    loaded = load_model(ModelConfig(device="cpu"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=512 << 20, threads=args.threads))
    clean = engine.stats()
    prof_p = profile_engine(engine, decode_batches=())
    prof_d = profile_engine(engine, prefill_sizes=())
    assert engine.stats() == clean, "the profile left something behind"

    models = {"default prior, frozen": PrefillCostModel(), "default prior + online fit": PrefillCostModel(),
              "profile prior, frozen": PrefillCostModel.from_profile(prof_p.prefill, chunk_tokens=prof_p.chunk_tokens),
              "profile prior + online fit": PrefillCostModel.from_profile(prof_p.prefill, chunk_tokens=prof_p.chunk_tokens)}
    online = {"default prior + online fit", "profile prior + online fit"}
    errors: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    samples = []
    for i, tokens in enumerate(workload(n_req, engine.vocab_size)):
        n, ctx, actual = run_prefill(engine, tokens, f"r{i}")
        samples.append((n, ctx, actual))
        for name, m in models.items():
            errors[name].append((m.predict(n, ctx), actual))
            if name in online:
                m.observe(n, ctx, actual)

    fmt = lambda ws: "[" + ", ".join(f"{w:.4g}" for w in ws) + "]"  # noqa: E731
    lines = [f"# Prefill cost model vs realized prefill ({platform.machine()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s), {n_req} requests)", "",
             f"profile: prefill part {prof_p.seconds:.2f} s, decode part {prof_d.seconds:.2f} s",
             "profile prefill samples (new, cached, s): "
             + ", ".join(f"({n}, {c}, {s:.3f})" for n, c, s in prof_p.prefill),
             "profile decode samples (batch, s/step): " + ", ".join(f"({b}, {s:.4f})" for b, s in prof_d.decode),
             f"weights [fixed s, s/1k tokens, s/1e6 pairs, extra s/1e6 masked pairs]: default {fmt(PrefillCostModel().weights)}, "
             f"profile {fmt(models['profile prior, frozen'].weights)}, "
             f"profile + online at the end {fmt(models['profile prior + online fit'].weights)}",
             "requests (new, cached, s): " + ", ".join(f"({n}, {c}, {s:.2f})" for n, c, s in samples), ""]
    lines += summarize(errors, n_req // 2)
    report = "\n".join(lines)
    publish(report, args.out)


if __name__ == "__main__":
    main()
