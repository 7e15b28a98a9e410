"""Weight-only int8: the packed kernel computes what the dequantized weights compute, the
engine stays close to transformers running those same dequantized weights (its float
reference), and a configuration the kernel cannot serve is refused by name."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, ModelLoadError, load_model
from mooncake.engine.int8 import INT8_MAX_ROWS, Int8Projection, quantize_rows
from mooncake.protocol import Sampling

STEPS = 16
GREEDY = Sampling(max_tokens=STEPS, temperature=0, ignore_eos=True)


def test_rows_quantize_to_int8_with_a_scale_per_row():
    w = torch.randn(64, 32) * torch.linspace(0.01, 3, 64)[:, None]
    w8, scale = quantize_rows(w)
    assert w8.dtype == torch.int8 and scale.shape == (64,)
    assert int(w8.abs().amax(1).min()) == 127  # every row uses the full range
    assert torch.allclose(w8.float() * scale[:, None], w, atol=float(scale.max()) / 2 + 1e-6)


def test_packed_kernel_matches_the_dequantized_weight_at_every_row_count():
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    proj = Int8Projection(weight, bias, [64, 16, 16])
    assert torch.equal(weight, proj.w8.bfloat16() * proj.scale[:, None])  # dequantized in place
    for rows in (1, 3, INT8_MAX_ROWS - 1, INT8_MAX_ROWS, 40):  # packed kernel below the threshold
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        q, k, v = proj(x)
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(torch.cat([q, k, v], -1).float(), want, atol=0.05, rtol=0.02)


def test_int8_engine_is_close_to_its_float_reference():
    """Greedy tokens of each side within the other's top 5 until the first divergence, and
    the sequences agree for a good stretch."""
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int8"))
    assert loaded.model_id.endswith("/bfloat16-int8")
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20))
    ref = loaded.hf_model  # now holds the dequantized weights: the int8 engine's float reference
    tok = loaded.tokenizer
    agreed = 0
    for text in ("The capital of France is", "def fibonacci(n):"):
        ids = tok(text)["input_ids"]
        seq = engine.add_sequence("r", ids, GREEDY)
        while not seq.prefilled:
            engine.prefill(seq)
        while not seq.finished:
            engine.decode_step([seq])
        engine.free(seq)
        ours = seq.tokens[len(ids):]
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=2,
                               output_logits=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(ids):].tolist()
        for t in range(STEPS):
            assert ours[t] in out.logits[t][0].float().topk(5).indices.tolist(), t
            if ours[t] != theirs[t]:
                break
            agreed += 1
    assert agreed >= STEPS


def test_int8_needs_bfloat16_on_cpu():
    with pytest.raises(ModelLoadError, match="quantization 'int8' runs on CPU in bfloat16"):
        load_model(ModelConfig(device="cpu", dtype="float32", quantization="int8"))
