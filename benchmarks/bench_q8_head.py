"""The bundled model's lm_head (49152 x 576, Q8_0 in the GGUF) as the engine serves it, the file's
int8 values and float16 scales per group of 32 (``engine/model/q8.py``), against the same weights
rounded again to int8 with one scale per row (``Int8Projection``, what it was before): calls of
1 and 4 rows, back to back (the weights hot in the L3 cache) and with 64 MB touched before each
call (as a decode step's other weights leave it), the two heads alternated in random order.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_q8_head.py [--calls 600]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.model.int8 import Int8Projection
from mooncake.engine.model.q8 import Q8Projection


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16"))
    head = Engine(loaded, EngineConfig(kv_cache_bytes=8 << 20, profile_at_start=False)).model.spec.head
    if not isinstance(head, Q8Projection) or head.kernel is None:
        raise SystemExit("the head is not on the Q8_0 kernel here (no AVX-512 VNNI, or no compiler)")
    rows = Int8Projection(head.weight.clone(), None, None, Int8Projection.load_kernel())
    heads = {"Q8_0 as stored": head, "int8 rows": rows}
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    random.seed(0)
    print("| rows | cache | " + " | ".join(f"{k} (µs)" for k in heads) + " | ratio |")
    print("|---|---|" + "---|" * (len(heads) + 1))
    for m in (1, 4):
        x = torch.randn(m, head.weight.shape[1], generator=gen).bfloat16()
        for cold in (False, True):
            times: dict[str, list[float]] = {k: [] for k in heads}
            for h in heads.values():
                for _ in range(20):
                    h.small(x)
            for _ in range(args.calls):
                order = list(heads.items())
                random.shuffle(order)
                for k, h in order:
                    if cold:
                        flush.add_(1)
                    t = time.perf_counter()
                    h.small(x)
                    times[k].append(time.perf_counter() - t)
            med = [statistics.median(v) * 1e6 for v in times.values()]
            print(f"| {m} | {'cold' if cold else 'hot'} | " + " | ".join(f"{v:.0f}" for v in med)
                  + f" | {med[0] / med[1]:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
