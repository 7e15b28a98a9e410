"""The serving dtype: ``auto`` picks bfloat16 where the hardware multiplies it natively, and
the bundled model in bfloat16 stays close to transformers in bfloat16 (float32 exactness
is tests/test_engine_oracle.py's)."""

from __future__ import annotations

import argparse

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.loading import loader
from mooncake.protocol import Sampling
from mooncake.testing.engine_run import run_alone

STEPS = 16
GREEDY = Sampling(max_tokens=STEPS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("flags, fast", [
    ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("fpu sse avx2 amx_bf16 amx_tile amx_int8", True),
    ("fpu sse avx2 avx512f avx512_vnni", False),
])
def test_fast_bf16_is_read_from_the_cpu_flags(flags, fast):
    cpuinfo = f"processor\t: 0\nmodel name\t: some cpu\nflags\t\t: {flags}\n"
    assert loader.cpu_has_fast_bf16(cpuinfo) is fast


@pytest.mark.parametrize("fast, device, expected", [
    (True, "cpu", torch.bfloat16), (False, "cpu", torch.float32),
    (False, "cuda", torch.bfloat16), (True, "cuda", torch.bfloat16),
])
def test_auto_dtype(monkeypatch, fast, device, expected):
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda cpuinfo=None: fast)
    assert loader.resolve_dtype("auto", torch.device(device)) == expected
    assert loader.resolve_dtype("float32", torch.device(device)) == torch.float32  # explicit wins


def test_dtype_flag_on_serve_overrides_the_config():
    from mooncake.cli import _overrides
    from mooncake.config import load_config

    args = argparse.Namespace(model=None, api_key=None, host=None, port=None, data_dir=None,
                              served_model_name=None, max_model_len=None, dtype="bfloat16")
    assert load_config(None, _overrides(args), env={}).model.dtype == "bfloat16"
    args.dtype = None
    assert load_config(None, _overrides(args), env={}).model.dtype == "auto"


def _greedy_with_logits(model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=model.device),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [x[0].float().cpu() for x in out.logits]


def _last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    seq = engine.add_sequence("l", ids, GREEDY)
    while True:
        step = engine.prefill(seq)
        if step.done:
            engine.free(seq)
            return step.logits.float().cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_bfloat16_engine_is_close_to_transformers_in_bfloat16(device):
    """At every step until the first divergence, each side's greedy token is within the
    other's top 5; the sequences agree for a good stretch (a wrong forward would not)."""
    from transformers import AutoModelForCausalLM

    bf16 = load_model(ModelConfig(device=device, dtype="bfloat16", quantization="none"))
    assert bf16.dtype == torch.bfloat16 and bf16.model_id.endswith("/bfloat16")
    engine = Engine(bf16, EngineConfig(kv_cache_bytes=32 << 20, threads=0))
    ref = AutoModelForCausalLM.from_pretrained(bf16.model_dir, dtype=torch.bfloat16).to(device).eval()
    tok = bf16.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    agreed = 0
    for ids in (list(chat), tok("The history of the printing press begins")["input_ids"]):
        ours = run_alone(engine, ids, GREEDY)
        theirs, their_logits = _greedy_with_logits(ref, ids, STEPS)
        for t in range(STEPS):
            our_logits = _last_logits(engine, ids + ours[:t])
            assert ours[t] in their_logits[t].topk(5).indices.tolist(), t
            assert theirs[t] in our_logits.topk(5).indices.tolist(), t
            if ours[t] != theirs[t]:
                break
            agreed += 1
    assert agreed >= STEPS
