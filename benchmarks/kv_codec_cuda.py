"""The KV codecs on CUDA (issue 33): encoding on the GPU gives the bytes encoding on the CPU gives
(so a GPU prefill and a CPU decode, or a store, read each other's blocks), how fast both
directions run there, and a GPU engine's KV exported encoded and landed in another GPU engine.

A SmolLM2-135M-shaped Llama with random weights made here (a lent GPU host has no weights),
bfloat16 on ``cuda``. Engine part: a ``--prompt``-token prompt prefilled on engine A, its KV exported
(encoded on the GPU) and written into engine B's reservation (decoded on the GPU), then
``--steps`` greedy decode steps on both; reported: the time of the export + landing, the tokens
B decodes that equal A's, and the wire bytes.

    python3 benchmarks/kv_codec_cuda.py [--blocks 256] [--prompt 1300] [--steps 16] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.engine.loading.loader import LoadedModel
from mooncake.kv.codec import KVCodec
from mooncake.protocol import Sampling

SHAPE = (30, 2, 3, 16, 64)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 5) -> tuple[float, object]:
    """Median seconds of ``fn()`` (synchronised on CUDA), and its last result."""
    times, out = [], None
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def codec_part(blocks: int, device: str) -> list[dict]:
    rows = []
    x_cpu = (torch.randn(blocks, *SHAPE) * torch.logspace(-1, 1, 64)).to(torch.bfloat16)
    x = x_cpu.to(device)
    for name in ("int8", "fp8"):
        codec = KVCodec(name, SHAPE, torch.bfloat16)
        enc_s, enc = timed(lambda: codec.encode(x))
        dec_s, dec = timed(lambda: codec.decode(enc))
        same_bytes = torch.equal(enc.cpu(), codec.encode(x_cpu))
        same_values = torch.equal(dec.cpu(), codec.decode(enc.cpu()))
        rel = float((dec.float() - x.float()).norm() / x.float().norm())
        gb = x.nbytes / 1e9
        rows.append({"codec": name, "blocks": blocks, "gpu_bytes_equal_cpu": same_bytes,
                     "gpu_values_equal_cpu": same_values, "rel_err": rel,
                     "encode_GBps": gb / enc_s, "decode_GBps": gb / dec_s})
    return rows


def random_model(device: str) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval().requires_grad_(False)
    return LoadedModel(model, None, Path("."), "random-smollm2@0/bfloat16", "random", torch.device(device),
                       torch.bfloat16)


def engine_part(prompt: int, steps: int, device: str) -> list[dict]:
    from dataclasses import replace

    base = random_model(device)
    ids = torch.randint(100, 40000, (prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = Sampling(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    rows = []
    for name in ("none", "int8", "fp8"):
        loaded = replace(base, kv_codec=name, model_id=base.model_id + ("" if name == "none" else "+kv_" + name))
        a, b = (Engine(loaded, EngineConfig(kv_cache_bytes=256 << 20, native_kernels=False)) for _ in range(2))
        seq = a.add_sequence("a", ids, greedy)
        while not seq.prefilled:
            step = a.prefill(seq)
        first = int(step.token)
        sync()
        t0 = time.perf_counter()
        kv = a.kv.export_sequence(seq).cpu()  # what leaves for the wire
        into = b.reserve("b", ids, seq.hashes, seq.root, greedy)
        b.kv.write_kv(into, 0, kv)
        sync()
        hand_s = time.perf_counter() - t0
        b.begin_decoding(into, first)
        for _ in range(steps):
            a.decode_step([seq])
            b.decode_step([into])
        same = sum(x == y for x, y in zip(seq.tokens[prompt:], into.tokens[prompt:]))
        rows.append({"codec": name, "prompt": prompt, "wire_MB": kv.nbytes / 1e6, "handoff_s": hand_s,
                     "tokens_equal": f"{same} of {steps + 1}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1300)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cpu: the same checks here (no GPU against CPU)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch.__version__, flush=True)
    for row in codec_part(args.blocks, args.device) + engine_part(args.prompt, args.steps, args.device):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
