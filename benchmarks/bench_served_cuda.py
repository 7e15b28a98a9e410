"""Decode throughput of the engine alone against the same through `mooncake serve` (every role a
process, the HTTP API), on CUDA, bfloat16: how much of the engine's speed a user gets.

    python3 benchmarks/bench_served_cuda.py --shape DIR [--batch 32] [--steps 512]

One model of ``--shape``'s architecture (a model directory: its config.json and tokenizer; default
the bundled SmolLM2-135M's converted directory) with random weights made here, so a machine without
the weights (a lent GPU host) runs it too. Engine: ``--batch`` sequences of a 64-token prompt,
prefilled, then ``--steps`` decode steps of the whole batch (best of 3). Served: ``--batch``
concurrent streamed completions of such prompts, ``--steps`` tokens each (``ignore_eos``), output
tokens over wall time (best of 2 after a warm-up round), each request's median inter-token gap, and
one request alone.
"""
import argparse, os, shutil, statistics, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="", help="model directory whose config and tokenizer to use")
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--steps", type=int, default=512)
args = ap.parse_args()
B, P, S = args.batch, 64, args.steps
OUT = tempfile.mkdtemp(prefix="bench-served-cuda-")
model_dir = Path(OUT) / "model"


def make_model() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = args.shape
    if not shape:
        from mooncake.config import ModelConfig
        from mooncake.engine.loading.loader import resolve_model_dir
        shape = str(resolve_model_dir(ModelConfig(dtype="float32"))[0])
    model_dir.mkdir(parents=True)
    for f in Path(shape).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, model_dir / f.name)
    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    m.save_pretrained(model_dir, safe_serialization=True)


def engine_tok_s() -> float:
    from mooncake.config import EngineConfig, ModelConfig
    from mooncake.engine import Engine, load_model
    from mooncake.protocol import Sampling
    loaded = load_model(ModelConfig(path=str(model_dir), device="cuda", dtype="bfloat16"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=2 << 30, max_batch=max(32, B), prefix_caching=False))
    ids = loaded.tokenizer.encode("Once upon a time " * 40)[:P]
    best = 0.0
    for rep in range(3):
        seqs = [engine.add_sequence(f"r{rep}-{i}", ids, Sampling(max_tokens=S + 1, temperature=0, ignore_eos=True))
                for i in range(B)]
        for s in seqs:
            while not s.prefilled:
                engine.prefill(s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(S):
            engine.decode_step(seqs)
        torch.cuda.synchronize()
        best = max(best, B * S / (time.perf_counter() - t0))
        for s in seqs:
            engine.free(s)
    return best


def served() -> tuple[float, float, float]:
    port = 8124
    url = f"http://127.0.0.1:{port}"
    log = open(f"{OUT}/serve_bench.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.cli", "serve", "--model", str(model_dir), "--dtype",
                             "bfloat16", "--port", str(port), "--data-dir", f"{OUT}/data", "--log-level", "warning"],
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "MOONCAKE_ENGINE_MAX_BATCH": str(max(32, B))},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.time()
        while True:
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() - t0 < 240, "serve did not come up"
            time.sleep(1)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        ids = httpx.post(url + "/tokenize", json={"model": name, "prompt": "Once upon a time " * 40}).json()["tokens"][:P]

        def one(k: int) -> tuple[int, list[float]]:
            body = {"model": name, "prompt": [k % 1000 + 1] + ids[1:], "max_tokens": S, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            stamps = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.perf_counter())
            return len(stamps), [b - a for a, b in zip(stamps, stamps[1:])]

        with ThreadPoolExecutor(B) as pool:
            list(pool.map(one, range(B)))  # warm-up: kernels, the cost models
            best, itl = 0.0, 0.0
            for rep in range(2):
                t0 = time.perf_counter()
                results = list(pool.map(one, range(B * (rep + 2), B * (rep + 3))))
                dt = time.perf_counter() - t0
                rate = sum(n for n, _ in results) / dt
                if rate > best:
                    best = rate
                    itl = statistics.median(statistics.median(g) for _, g in results if g)
        ttft_probe = time.perf_counter()
        one(7)
        return best, itl * 1e3, time.perf_counter() - ttft_probe
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


make_model()
print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
e = engine_tok_s()
print(f"engine alone: batch {B} decode, {S} steps: {e:.0f} tok/s (best of 3)", flush=True)
s, itl, one_s = served()
print(f"served: {B} concurrent streams x {S} tokens: {s:.0f} output tok/s (best of 2), median ITL {itl:.1f} ms; "
      f"one request alone {one_s:.2f} s; served/engine {s / e:.2f}", flush=True)
