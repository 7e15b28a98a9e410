"""Engine vs transformers eager on the same model: prefill, batched decode, suffix prefill.

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--threads N] [--device cpu|cuda] [--out FILE]

Medians of ``--reps`` repetitions (decode: of ``steps`` per-step times); both sides
measured in the same process, alternating rep by rep, on the same weights (the engine runs on the transformers
model's own tensors). Prompts are random token ids (distinct per repetition, so
no prefix hits unless measured on purpose).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.protocol import Sampling
from mooncake.bench.publish import publish

GREEDY = Sampling(max_tokens=1 << 20, temperature=0, ignore_eos=True)


def synchronize() -> None:
    """Wait for queued GPU work (transformers returns before CUDA kernels finish)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def paired(fa, fb, reps: int) -> tuple[float, float]:
    """Median seconds of ``fa`` and ``fb``, run alternately so that load changes on a shared
    machine hit both sides alike."""
    fa(), fb()  # warm-up
    ta, tb = [], []
    for _ in range(reps):
        for fn, out in ((fa, ta), (fb, tb)):
            synchronize()
            t = time.perf_counter()
            fn()
            synchronize()
            out.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


class Bench:
    def __init__(self, engine: Engine, hf, reps: int) -> None:
        self.engine, self.hf, self.reps = engine, hf, reps
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = engine.vocab_size
        self.device = next(hf.parameters()).device

    def ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, device=self.device)

    def prompt(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab, (n,), generator=self.gen).tolist()

    def prefill_engine(self, ids_fn) -> None:
        s = self.engine.add_sequence("p", ids_fn(), GREEDY)
        while not s.prefilled:
            self.engine.prefill(s)
        self.engine.free(s)

    @torch.inference_mode()
    def prefill(self, n: int) -> tuple[float, float]:
        ours, theirs = paired(lambda: self.prefill_engine(lambda: self.prompt(n)),
                              lambda: self.hf(self.ids([self.prompt(n)]), use_cache=True, logits_to_keep=1),
                              self.reps)
        return n / ours, n / theirs

    @torch.inference_mode()
    def decode(self, batch: int, ctx: int, steps: int) -> tuple[float, float]:
        eng = self.engine
        seqs = [eng.add_sequence("d%d" % i, self.prompt(ctx), GREEDY) for i in range(batch)]
        assert all(s is not None for s in seqs), "KV pool too small for the decode batch"
        for s in seqs:
            while not s.prefilled:
                eng.prefill(s)
        ids = self.ids([self.prompt(ctx) for _ in range(batch)])
        out = self.hf(ids, use_cache=True, logits_to_keep=1)
        state = {"pkv": out.past_key_values, "nxt": out.logits[:, -1:].argmax(-1)}

        def hf_step() -> None:
            o = self.hf(state["nxt"], past_key_values=state["pkv"], use_cache=True)
            state["pkv"], state["nxt"] = o.past_key_values, o.logits[:, -1:].argmax(-1)

        ours_s, theirs_s = paired(lambda: eng.decode_step(seqs), hf_step, steps)
        for s in seqs:
            eng.free(s)
        ours, theirs = batch / ours_s, batch / theirs_s
        return ours, theirs

    @torch.inference_mode()
    def suffix(self, prefix: int, suffix: int) -> dict[str, float]:
        """Seconds to prefill ``suffix`` new tokens after a cached ``prefix``, and cold."""
        eng = self.engine
        base = self.prompt(prefix)
        warm_seq = eng.add_sequence("w", base + self.prompt(suffix), GREEDY)  # leaves the prefix cached
        while not warm_seq.prefilled:
            eng.prefill(warm_seq)
        eng.free(warm_seq)
        pkv = self.hf(self.ids([base]), use_cache=True, logits_to_keep=1).past_key_values
        caches = [copy.deepcopy(pkv) for _ in range(self.reps + 1)]
        ours_warm, hf_warm = paired(
            lambda: self.prefill_engine(lambda: base + self.prompt(suffix)),
            lambda: self.hf(self.ids([self.prompt(suffix)]), past_key_values=caches.pop(), use_cache=True,
                            logits_to_keep=1), self.reps)
        ours_cold, hf_cold = paired(
            lambda: self.prefill_engine(lambda: self.prompt(prefix + suffix)),
            lambda: self.hf(self.ids([self.prompt(prefix + suffix)]), use_cache=True, logits_to_keep=1),
            self.reps)
        return {"ours_warm": ours_warm, "ours_cold": ours_cold, "hf_warm": hf_warm, "hf_cold": hf_cold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short run: fewer sizes, reps and steps")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per point (default 5, quick 2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="serving dtype (auto: bfloat16 on CUDA and where the CPU has AMX or AVX-512 BF16)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides run")
    ap.add_argument("--chunk-tokens", type=int, default=EngineConfig().prefill_chunk_tokens,
                    help="the engine's prefill_chunk_tokens")
    ap.add_argument("--max-batch", type=int, default=EngineConfig().max_batch, help="the engine's max_batch")
    ap.add_argument("--out", default="", help="also write the markdown report here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    reps = a.reps or (2 if a.quick else 5)
    prefill_sizes = [128, 512] if a.quick else [128, 512, 2048]
    batches = [1, 8] if a.quick else [1, 8, 32] + ([128] if a.device == "cuda" else [])
    steps = 4 if a.quick else 16
    loaded = load_model(ModelConfig(device=a.device, dtype=a.dtype))
    eng = Engine(loaded, EngineConfig(kv_cache_bytes=(4 << 30 if a.device == "cuda" else (1 << 30) + (256 << 20)),
                                      prefill_chunk_tokens=a.chunk_tokens, max_batch=a.max_batch))
    b = Bench(eng, loaded.hf_model, reps)
    rows = ["| measurement | mooncake engine | transformers eager | ratio |", "|---|---|---|---|"]
    for n in prefill_sizes:
        ours, theirs = b.prefill(n)
        rows.append("| prefill %d tokens (tok/s) | %.0f | %.0f | %.2fx |" % (n, ours, theirs, ours / theirs))
        print(rows[-1], flush=True)
    for bs in batches:
        ours, theirs = b.decode(bs, 512, steps)
        rows.append("| decode batch %d, ctx 512 (tok/s) | %.1f | %.1f | %.2fx |" % (bs, ours, theirs, ours / theirs))
        print(rows[-1], flush=True)
    pre, suf = (448, 64) if a.quick else (1920, 128)
    r = b.suffix(pre, suf)
    rows.append("| %d-token suffix after %d cached (s) | %.3f | %.3f | %.2fx faster |"
                % (suf, pre, r["ours_warm"], r["hf_warm"], r["hf_warm"] / r["ours_warm"]))
    rows.append("| same %d tokens cold (s) | %.3f | %.3f | %.2fx faster |"
                % (pre + suf, r["ours_cold"], r["hf_cold"], r["hf_cold"] / r["ours_cold"]))
    rows.append("| engine: cached vs cold speed-up | %.1fx | %.1fx (DynamicCache) | |"
                % (r["ours_cold"] / r["ours_warm"], r["hf_cold"] / r["hf_warm"]))
    print("\n".join(rows[-3:]), flush=True)
    where = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine()
    head = ("model %s, %s, %s, torch %s, %d threads, prefill chunks %d, max batch %d, %s, reps %d (median, "
            "alternating), decode steps %d"
            % (loaded.model_id, loaded.dtype, where, torch.__version__, a.chunk_tokens, a.max_batch,
               torch.get_num_threads(), "quick" if a.quick else "full", reps, steps))
    report = head + "\n\n" + "\n".join(rows) + "\n"
    print()
    publish(report, a.out)


if __name__ == "__main__":
    main()
