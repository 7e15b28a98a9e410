"""The engine's own int8 kernel (``mooncake/engine/kernels/native.py``) against torch's
 ``aten._weight_int8pack_mm`` for one activation row through each projection shape of
the bundled model (30 copies of each layer's weight, taken in turn, so reads come from memory
as in a decode step, not from cache); then decode batch 1 (context 512) of the bf16 + int8
engine with ``native_kernels`` on and off, taking turns over ``--rounds``. Also the decode step's
own attention (rotary + KV write + one-token attention, ``native_decode.py``) against torch's SDPA on
the same workspace (the bundled model's 30 layers taken in turn, 512 keys), and its RMSNorm with the
residual add against torch's two ops, at batch 1 and 32.

    .venv/bin/python benchmarks/bench_native_kernels.py [--threads N] [--rounds R] [--ops-only]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.kernels.native import load_kernel
from mooncake.engine.kernels.native_decode import load_decode_kernels
from mooncake.engine.model.rope import RopeParams, tables_of
from mooncake.protocol import Sampling

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
GREEDY = Sampling(max_tokens=1 << 20, temperature=0, ignore_eos=True)


def median_us(fn: Callable[[], object], n: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def shapes_table() -> list[str]:
    kernel = load_kernel()
    assert kernel is not None, "the engine's int8 kernel cannot run on this machine"
    rows = ["| shape (N x K) | torch (µs) | own (µs) | torch GB/s | own GB/s | own / torch |", "|---|---|---|---|---|---|"]
    for name, (N, K) in SHAPES.items():
        copies = 1 if name == "lm_head" else 30
        ws = [torch.randint(-127, 128, (N, K), dtype=torch.int8) for _ in range(copies)]
        scale = torch.rand(N) / 100
        scale_b = scale.bfloat16()
        x = torch.randn(1, K).bfloat16()
        turn = iter(range(1 << 62))
        t_torch = median_us(lambda: torch.ops.aten._weight_int8pack_mm(x, ws[next(turn) % copies], scale_b), 200)
        t_own = median_us(lambda: kernel(x, ws[next(turn) % copies], scale), 200)
        rows.append(f"| {name} ({N} x {K}) | {t_torch:.1f} | {t_own:.1f} | {N * K / t_torch / 1e3:.1f} | "
                    f"{N * K / t_own / 1e3:.1f} | {t_torch / t_own:.2f}x faster |")
    return rows


def decode_ops_table(ctx: int = 512) -> list[str]:
    """Per layer, bf16, SmolLM2's shapes (9 query heads, 3 kv heads, head dim 64, hidden 576)."""
    k = load_decode_kernels()
    assert k is not None, "the engine's decode kernels cannot run on this machine"
    L, H, Hkv, D, kcap = 30, 9, 3, 64, 768
    cos, sin = tables_of(RopeParams("default", 1e4, {}), D, 2048, torch.bfloat16, torch.device("cpu"))
    rows = ["| op, batch | torch (µs per layer) | own (µs per layer) | own / torch |", "|---|---|---|---|"]
    for B in (1, 32):
        ws = torch.randn(L, 2, B, Hkv, kcap, D).bfloat16()
        qkv = torch.randn(B, (H + 2 * Hkv) * D).bfloat16()
        pos = torch.full((B,), ctx, dtype=torch.int64)
        mask = (torch.arange(ctx + 1)[None, :] <= pos[:, None])[:, None, None] if B > 1 else None
        q = qkv[:, :H * D].reshape(B, Hkv, H // Hkv, D)
        turn = iter(range(1 << 62))

        def sdpa() -> object:
            wl = ws[next(turn) % L]
            return torch.nn.functional.scaled_dot_product_attention(q, wl[0, :, :, :ctx + 1], wl[1, :, :, :ctx + 1],
                                                                    attn_mask=mask)

        t_torch = median_us(sdpa, 60)
        t_own = median_us(lambda: k.attention(qkv, cos, sin, ws[next(turn) % L], pos, H, None, D ** -0.5), 60)
        rows.append(f"| attention, {ctx + 1} keys, batch {B} | {t_torch:.1f} | {t_own:.1f} | {t_torch / t_own:.2f}x faster |")
        x, a, w = torch.randn(B, 576).bfloat16(), torch.randn(B, 576).bfloat16(), torch.rand(576).bfloat16()

        def torch_norm() -> object:
            x.add_(a)
            return torch.nn.functional.rms_norm(x, (576,), w, 1e-5)

        t_torch = median_us(torch_norm, 300)
        t_own = median_us(lambda: k.add_rmsnorm(x, a, w, 1e-5), 300)
        rows.append(f"| residual add + RMSNorm, batch {B} | {t_torch:.1f} | {t_own:.1f} | {t_torch / t_own:.2f}x faster |")
    return rows


def decode_b1(eng: Engine, gen: torch.Generator, steps: int) -> float:
    seq = eng.add_sequence("d", torch.randint(100, eng.vocab_size, (512,), generator=gen).tolist(), GREEDY)
    assert seq is not None
    while not seq.prefilled:
        eng.prefill(seq)
    eng.decode_step([seq])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.decode_step([seq])
        times.append(time.perf_counter() - t)
    eng.free(seq)
    return 1 / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ops-only", action="store_true", help="the per-op tables only, not the engine A/B")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("\n".join(shapes_table()), flush=True)
    print("\n" + "\n".join(decode_ops_table()), flush=True)
    if a.ops_only:
        return
    engines = {}
    for native in (False, True):
        loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int8"))
        engines[f"{'own' if native else 'torch'} kernel"] = Engine(
            loaded, EngineConfig(kv_cache_bytes=256 << 20, profile_at_start=False, native_kernels=native))
    gen = torch.Generator().manual_seed(0)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for rnd in range(a.rounds):
        for n, eng in engines.items():
            rates[n].append(decode_b1(eng, gen, a.steps))
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()), flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    print(f"\ndecode batch 1, ctx 512, bf16 + int8 (tok/s, median of {a.rounds} rounds): torch kernel "
          f"{med['torch kernel']:.1f}, own kernel {med['own kernel']:.1f} = {med['own kernel'] / med['torch kernel']:.2f}x")


if __name__ == "__main__":
    main()
