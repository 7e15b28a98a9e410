"""Each family's tiny model: the engine's own forward vs transformers, same run, same weights.

    .venv/bin/python benchmarks/bench_families.py [--threads N] [--reps N] [--out FILE]

Per family (``mooncake.engine.loading.tiny_models``: 3 layers, hidden 64, the bundled tokenizer's
49,152-token vocabulary or ``--vocab``, each family's own features switched on: sliding windows,
soft-capping, fused projections, q/k norms): prefill tokens/s of a random 256-token prompt,
and decode tokens/s at batch 1 and batch 32 over a 128-token context. Both sides in the same
process, alternating rep by rep (``bench_engine.paired``), medians; transformers runs the
model's default attention (eager for Gemma 2, sdpa otherwise) with its DynamicCache.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import torch

from mooncake.bench.publish import publish
from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.loading.tiny_models import FAMILIES, build_tiny_model

from bench_engine import Bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per point")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per point")
    ap.add_argument("--vocab", type=int, default=0,
                    help="vocabulary size (default: the tokenizer's 49152; smaller: less LM-head-bound)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    ap.add_argument("--out", default="", help="also write the markdown report here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tokenizer = load_model(ModelConfig(device="cpu")).tokenizer
    rows = ["| family | measurement | mooncake engine | transformers | ratio |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            loaded = load_model(ModelConfig(path=str(build_tiny_model(family, Path(tmp) / family, tokenizer,
                                                                       vocab_size=a.vocab)),
                                            device="cpu"))
            b = Bench(Engine(loaded, EngineConfig(kv_cache_bytes=64 << 20)), loaded.hf_model, a.reps)
            points = [("prefill 256 tokens", b.prefill(256))]
            points += [(f"decode batch {n}, ctx 128", b.decode(n, 128, a.steps)) for n in (1, 32)]
            for what, (ours, theirs) in points:
                rows.append(f"| {family} | {what} (tok/s) | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")
                print(rows[-1], flush=True)
    head = ("tiny models (3 layers, hidden 64, vocab %d), float32, %s, torch %s, %d thread(s), reps %d "
            "(median, alternating), decode steps %d"
            % (a.vocab or len(tokenizer), platform.processor() or platform.machine(), torch.__version__,
               torch.get_num_threads(), a.reps, a.steps))
    report = head + "\n\n" + "\n".join(rows) + "\n"
    print()
    publish(report, a.out)


if __name__ == "__main__":
    main()
