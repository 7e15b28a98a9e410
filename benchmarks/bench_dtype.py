"""The engine in float32, bfloat16 and bfloat16 + weight-only int8, in one run: prefill
tok/s at 2,048 tokens, decode tok/s at batch 1 and batch 32 (context 512); and, where
``make bench-setup`` built it, llama.cpp's ``llama-server`` decoding one request at context
512 on the same GGUF and the same threads (its own ``predicted_per_second``).

    .venv/bin/python benchmarks/bench_dtype.py [--quick] [--threads N] [--rounds R] [--out FILE]
                                               [--llama-server PATH] [--device cpu|cuda]

Medians of ``--reps`` prefills and of ``--steps`` decode steps per point, then medians over
``--rounds`` sweeps; the variants take turns point by point, so load changes on a shared
machine hit them alike. Prompts are random token ids (no prefix hits). On ``--device cuda``:
float32 and bfloat16 (int8 is CPU-only), batch 128 too, no llama-server (a CPU build).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.loading.loader import cpu_has_fast_bf16, default_model_path
from mooncake.protocol import Sampling
from mooncake.bench.publish import publish

GREEDY = Sampling(max_tokens=1 << 20, temperature=0, ignore_eos=True)
LLAMA_SERVER = Path(__file__).resolve().parent.parent / ".bench" / "llama" / "build" / "bin" / "llama-server"
VARIANTS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "bfloat16 + int8": ("bfloat16", "int8"),
            "bfloat16 + int4": ("bfloat16", "int4")}


def prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def prefill_tok_s(eng: Engine, n: int, reps: int, gen: torch.Generator) -> float:
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        s = eng.add_sequence("p", prompt(gen, n, eng.vocab_size), GREEDY)
        t = time.perf_counter()
        while not s.prefilled:
            eng.prefill(s)
        times.append(time.perf_counter() - t)
        eng.free(s)
    return n / statistics.median(times[1:])


def decode_tok_s(eng: Engine, batch: int, ctx: int, steps: int, gen: torch.Generator) -> float:
    seqs = [eng.add_sequence("d%d" % i, prompt(gen, ctx, eng.vocab_size), GREEDY) for i in range(batch)]
    assert all(s is not None for s in seqs), "KV pool too small for the decode batch"
    for s in seqs:
        while not s.prefilled:
            eng.prefill(s)
    eng.decode_step(seqs)  # warm-up (gathers the workspace)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.decode_step(seqs)
        times.append(time.perf_counter() - t)
    for s in seqs:
        eng.free(s)
    return batch / statistics.median(times)


@contextlib.contextmanager
def llama_server(binary: Path, threads: int, ctx: int) -> Iterator[str]:
    """llama-server on the bundled GGUF with one slot of ``ctx`` tokens; yields its URL."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(binary), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-np", "1", "-c", str(ctx)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up: {Path(log.name).read_text()[-1000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def llama_decode_tok_s(url: str, ctx: int, steps: int, reps: int, gen: torch.Generator) -> float:
    """llama-server's decode rate for one request at ``ctx`` tokens of context: the median
    over ``reps`` completions (after a warm-up) of its own ``predicted_per_second``."""
    rates = []
    for _ in range(reps + 1):
        body = {"prompt": prompt(gen, ctx, 49152), "n_predict": steps, "ignore_eos": True, "temperature": 0,
                "cache_prompt": False}
        r = httpx.post(url + "/completion", json=body, timeout=300)
        r.raise_for_status()
        rates.append(float(r.json()["timings"]["predicted_per_second"]))
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps and steps, prefill at 512 tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--reps", type=int, default=0, help="prefills per point (default 5, quick 2)")
    ap.add_argument("--steps", type=int, default=0, help="decode steps per point (default 24, quick 6)")
    ap.add_argument("--out", default="", help="also write the markdown report here")
    ap.add_argument("--rounds", type=int, default=0, help="sweeps over all points, medians over them (default 3, quick 1)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="llama-server binary (skipped if absent)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the engine runs")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)
    reps, steps = a.reps or (2 if a.quick else 5), a.steps or (6 if a.quick else 24)
    prefill_n = 512 if a.quick else 2048
    a.rounds = a.rounds or (1 if a.quick else 3)
    variants = {n: v for n, v in VARIANTS.items() if not (cuda and v[1] != "none")}
    engines = {}
    for name, (dtype, quant) in variants.items():
        loaded = load_model(ModelConfig(device=a.device, dtype=dtype, quantization=quant))
        kv_bytes = 6 << 30 if cuda else (1 << 30) + (256 << 20)
        engines[name] = Engine(loaded, EngineConfig(kv_cache_bytes=kv_bytes, profile_at_start=False))
    gen = torch.Generator().manual_seed(0)
    points = [(f"prefill {prefill_n} tokens (tok/s)", lambda e: prefill_tok_s(e, prefill_n, reps, gen))]
    for bs in (1, 32, 128) if cuda else (1, 32):
        points.append((f"decode batch {bs}, ctx 512 (tok/s)", lambda e, bs=bs: decode_tok_s(e, bs, 512, steps, gen)))
    names = list(variants)
    results: dict[str, dict[str, list[float]]] = {label: {n: [] for n in names} for label, _ in points}
    peer: list[float] = []
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(llama_server(a.llama_server, torch.get_num_threads(), 1024)) \
            if a.llama_server.is_file() and not cuda else None
        for rnd in range(a.rounds):  # every point of every variant, then again: load changes hit all alike
            for label, fn in points:
                for n in names:
                    results[label][n].append(fn(engines[n]))
                print(f"round {rnd + 1}: {label}: " + ", ".join(f"{n} {results[label][n][-1]:.1f}" for n in names),
                      flush=True)
                if url is not None and label.startswith("decode batch 1,"):
                    peer.append(llama_decode_tok_s(url, 512, max(steps, 32), 3, gen))
                    print(f"round {rnd + 1}: llama-server decode batch 1: {peer[-1]:.1f}", flush=True)
    ratios = [n for n in names if n != "float32"]
    rows = ["| measurement | " + " | ".join(names) + " | " + " | ".join(f"{n} / f32" for n in ratios) + " |",
            "|---" * (len(names) + len(ratios) + 1) + "|"]
    for label, _ in points:
        r = {n: statistics.median(results[label][n]) for n in names}
        rows.append(f"| {label} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " | "
                    + " | ".join(f"{r[n] / r['float32']:.2f}x" for n in ratios) + " |")
    if peer:
        label = next(label for label, _ in points if label.startswith("decode batch 1,"))
        best = max(statistics.median(v) for v in results[label].values())
        rate = statistics.median(peer)
        rows.append(f"\nllama-server (same GGUF, Q4_1; 1 slot, same threads), decode batch 1, ctx 512: {rate:.1f} tok/s "
                    f"(median over rounds of the median of 3 requests of {max(steps, 32)} tokens); the engine's best "
                    f"variant: {best:.1f} tok/s = {best / rate:.2f}x")
    elif not cuda:
        rows.append(f"\nllama-server: not measured (no binary at {a.llama_server}; `make bench-setup` builds it)")
    where = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    head = (f"{where}, CPU bf16 natively: {cpu_has_fast_bf16()}, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, prefill reps {reps}, decode steps {steps}, "
            f"medians over {a.rounds} rounds")
    report = head + "\n\n" + "\n".join(rows) + "\n"
    print()
    publish(report, a.out)


if __name__ == "__main__":
    main()
