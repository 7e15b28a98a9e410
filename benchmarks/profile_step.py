"""What one decode step (or one prefill) is made of: its wall time, and torch's profile of one
(the ops that take the most CPU time; on CUDA also the kernels launched and the GPU's busy time).

    .venv/bin/python benchmarks/profile_step.py [--device cpu|cuda] [--dtype D] [--batches 1,32]
                                                [--prefill N]

A step whose wall time is far above the GPU's busy time is bound by the CPU (launches,
Python, per-call planning), not by the GPU. Prompts are random token ids, context 512.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.protocol import Sampling

GREEDY = Sampling(max_tokens=1 << 20, temperature=0, ignore_eos=True)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batches", default="1,32", help="decode batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per batch size")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--prefill", type=int, default=0, help="profile the prefill of an N-token prompt instead")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    loaded = load_model(ModelConfig(device=a.device, dtype=a.dtype))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=4 << 30 if a.device == "cuda" else 1 << 30,
                                         max_batch=max(batches), profile_at_start=False))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    gen = torch.Generator().manual_seed(0)
    if a.prefill:
        profile_prefill(engine, a.prefill, a.steps, a.device, activities, gen)
        return
    for batch in batches:
        seqs = [engine.add_sequence(f"d{i}", torch.randint(100, engine.vocab_size, (512,), generator=gen).tolist(),
                                    GREEDY) for i in range(batch)]
        for s in seqs:
            while not s.prefilled:
                engine.prefill(s)
        for _ in range(5):  # warm-up
            engine.decode_step(seqs)
        times = []
        for _ in range(a.steps):
            synchronize(a.device)
            t = time.perf_counter()
            engine.decode_step(seqs)
            synchronize(a.device)
            times.append(time.perf_counter() - t)
        with profile(activities=activities) as prof:
            engine.decode_step(seqs)
            synchronize(a.device)
        events = prof.key_averages()
        report(f"{loaded.dtype} on {a.device}, batch {batch}", times, events, a.device)
        for s in seqs:
            engine.free(s)


def profile_prefill(engine: Engine, n: int, reps: int, device: str, activities: list, gen: torch.Generator) -> None:
    def once() -> None:
        s = engine.add_sequence("p", torch.randint(100, engine.vocab_size, (n,), generator=gen).tolist(), GREEDY)
        while not s.prefilled:
            engine.prefill(s)
        engine.free(s)

    once()  # warm-up
    times = []
    for _ in range(max(1, reps // 10)):
        synchronize(device)
        t = time.perf_counter()
        once()
        synchronize(device)
        times.append(time.perf_counter() - t)
    with profile(activities=activities) as prof:
        once()
        synchronize(device)
    report(f"{engine.model.dtype} on {device}, prefill of {n} tokens", times, prof.key_averages(), device, rows=14)


def report(what: str, times: list[float], events, device: str, rows: int = 8) -> None:
    line = f"{what}: median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms"
    if device == "cuda":
        gpu = [e for e in events if e.device_type.name == "CUDA"]
        line += (f"; {sum(e.count for e in gpu)} GPU kernels, GPU busy "
                 f"{sum(e.self_device_time_total for e in gpu) / 1e3:.2f} ms")
    print(line, flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)


if __name__ == "__main__":
    main()
