"""Weight-only int8: the int8 kernels (torch's packed one and the engine's own) compute what
the dequantized weights compute, the engine in float32 is token-exact against transformers
running those same dequantized weights in float32 (its float reference) and in bfloat16 stays
close to them (both with int4 weights too), and a configuration the kernels cannot serve is
refused by name."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, ModelLoadError, load_model
from mooncake.engine.model.int8 import INT8_MAX_ROWS, Int8Projection, quantize_rows
from mooncake.engine.kernels.native import load_kernel
from mooncake.protocol import Sampling
from mooncake.testing.engine_run import run_alone

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


KERNEL = load_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX-512 VNNI here")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, INT8_MAX_ROWS - 1])
def test_own_kernel_computes_the_float_reference_to_float32_accuracy(rows):
    """Activations spanning 5 orders of magnitude (the int16 parts must keep the small ones),
    an output count that is not a multiple of the kernel's 4-row blocks."""
    gen = torch.Generator().manual_seed(rows)
    w8, scale = quantize_rows(torch.randn(203, 1536, generator=gen))
    x = torch.randn(rows, 1536, generator=gen) * torch.logspace(-3, 2, 1536)
    want = x.double() @ (w8.double() * scale.double()[:, None]).T
    got = KERNEL(x, w8, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, 203)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    xb = x.bfloat16()  # bfloat16 in, the float32 result rounded to bfloat16 out
    want_b = (xb.double() @ (w8.double() * scale.double()[:, None]).T).float().bfloat16()
    got_b = KERNEL(xb, w8, scale)
    assert got_b.dtype == torch.bfloat16
    assert (got_b != want_b).float().mean() < 0.01  # only sums within float32 rounding of a bf16 tie differ
    torch.testing.assert_close(got_b.float(), want_b.float(), rtol=8e-3, atol=1e-6 * float(want.abs().max()))


@needs_kernel
def test_own_kernel_refuses_what_it_cannot_compute():
    w8, scale = quantize_rows(torch.randn(8, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        KERNEL(torch.randn(1, 48), w8, scale)
    w8, scale = quantize_rows(torch.randn(8, 64))
    with pytest.raises(ValueError, match="int8 kernel takes"):
        KERNEL(torch.randn(1, 64).half(), w8, scale)  # a dtype it would misread
    with pytest.raises(ValueError, match="int8 kernel takes"):
        KERNEL(torch.randn(64, 2).T, w8, scale)  # not contiguous
    with pytest.raises(ValueError, match="int8 kernel takes"):
        KERNEL(torch.randn(1, 64), w8, scale.bfloat16())


@needs_kernel
def test_projection_uses_the_own_kernel_at_few_rows_only_where_rows_fit():
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(96, 64, generator=gen) * 0.05).bfloat16()
    proj = Int8Projection(weight, None, [64, 32], KERNEL)
    assert proj.kernel is KERNEL
    x = torch.randn(2, 64, generator=gen).bfloat16()
    q, k = proj(x)
    torch.testing.assert_close(torch.cat([q, k], -1).float(), x.float() @ weight.float().T, atol=0.02, rtol=0.02)
    assert Int8Projection(torch.randn(8, 48).bfloat16(), None, kernel=KERNEL).kernel is None  # 48: not a multiple of 32


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_engine_in_float32_is_token_exact_against_its_float_reference(scheme):
    """float32 + int8 or int4 (``test_engine_int4.py``): the engine (decode through the scheme's
    kernel, prefill through the dequantized weights) against transformers in float32 on the
    dequantized weights, up to and including an end-of-sequence token (transformers stops
    there; the engine, told to ignore it, goes on)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="float32", quantization=scheme))
    assert loaded.model_id.endswith(f"/float32-{scheme}")
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20, int4_activations="float"))  # int4's exact path
    ref, tok = loaded.hf_model, loaded.tokenizer
    for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=STEPS, do_sample=False, pad_token_id=2)
        theirs = out[0, len(ids):].tolist()
        assert len(theirs) >= 8 and run_alone(engine, ids, GREEDY)[:len(theirs)] == theirs, text


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_engine_is_close_to_its_float_reference(scheme):
    """Greedy tokens of each side within the other's top 5 until the first divergence, and
    the sequences agree for a good stretch."""
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization=scheme))
    assert loaded.model_id.endswith(f"/bfloat16-{scheme}")
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20))
    ref = loaded.hf_model  # now holds the dequantized weights: the quantized engine's float reference
    tok = loaded.tokenizer
    agreed = 0
    for text in ("The capital of France is", "def fibonacci(n):"):
        ids = tok(text)["input_ids"]
        ours = run_alone(engine, ids, GREEDY)
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


def test_int8_needs_bfloat16_or_float32_on_cpu():
    with pytest.raises(ModelLoadError, match="quantization 'int8' runs on CPU in bfloat16 or float32"):
        load_model(ModelConfig(device="cpu", dtype="float16", quantization="int8"))


def test_native_kernels_off_keeps_torchs_int8_kernel():
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int8"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=8 << 20, native_kernels=False, profile_at_start=False))
    assert all(layer.down.kernel is None for layer in engine.model.spec.layers)
