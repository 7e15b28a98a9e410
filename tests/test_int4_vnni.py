"""int4 x int8 (``int4_vnni.c``, ``[engine] int4_activations = "int8"``): activations rounded to
int8 per block of 32, integer dot products with the weights' nibbles. Within a stated bound of
the float reference (Q4_1 and Q4_0 groups, odd group counts, odd output counts), each row the
same in any batch, and the bundled model's greedy tokens agreeing with transformers'."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.kernels.native import Int4Gemv, load_int4_kernel
from mooncake.engine.model.int4 import Int4Projection, dequantize_groups, int4_groups, quantize_groups
from mooncake.protocol import Sampling
from mooncake.testing.engine_run import run_alone

KERNEL = load_int4_kernel(activations="int8")
FLOAT = load_int4_kernel(activations="float")
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX-512 VNNI here")
BOUND = Int4Gemv.ERROR_BOUND  # ||out - ref|| / ||ref||; measured 4.7e-3 .. 6e-3 on these shapes


def q4_0_grid(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Values d * (q - 8), q in 0..15, one value per group at level 0 (as llama.cpp writes Q4_0)."""
    q = torch.randint(1, 16, (n, k // 32, 32), generator=gen)
    q[..., 3] = 0
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3) * torch.where(torch.rand(n, k // 32, 1, generator=gen) < 0.5, -1, 1)
    return (d * (q - 8)).reshape(n, k)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@needs_kernel
@pytest.mark.parametrize("n,k", [(203, 1536), (77, 96), (64, 576), (5, 160), (1, 32)])
@pytest.mark.parametrize("layout", ["q4_1", "q4_0"])
def test_outputs_are_within_the_bound_of_the_float_reference(n, k, layout):
    """Odd group counts (3, 5, 1), output counts off the kernel's 4-row blocks, bf16 and f32."""
    gen = torch.Generator().manual_seed(n * k)
    if layout == "q4_1":
        groups = quantize_groups(torch.randn(n, k, generator=gen) * 0.05)
    else:
        groups = int4_groups(q4_0_grid(n, k, gen))
        assert groups is not None
    w = dequantize_groups(*groups).double()
    x = torch.randn(8, k, generator=gen) * torch.logspace(-1, 1, k)
    want = x.double() @ w.T
    got = KERNEL(x, *groups)
    assert got.dtype == torch.float32 and got.shape == (8, n)
    assert relative_error(got, want) < (BOUND if n * 8 >= 64 else 3 * BOUND)  # a handful of outputs: noisier
    assert relative_error(KERNEL(x.bfloat16(), *groups).float(), want) < (BOUND if n * 8 >= 64 else 3 * BOUND)
    assert relative_error(got, want) > 1e-5  # the activations are rounded: not the float path
    assert relative_error(FLOAT(x, *groups), want) < 1e-5


def test_q4_0_groups_come_back_exactly_and_full_precision_does_not():
    gen = torch.Generator().manual_seed(7)
    w = q4_0_grid(16, 128, gen)
    groups = int4_groups(w)
    assert groups is not None
    torch.testing.assert_close(dequantize_groups(*groups), w, rtol=0, atol=1e-7)
    groups = int4_groups(w.bfloat16())  # on the grid up to bfloat16's rounding of each value
    assert groups is not None
    torch.testing.assert_close(dequantize_groups(*groups), w, rtol=0, atol=2 ** -8 * 0.09)  # eps * |w|max
    assert int4_groups(torch.randn(16, 128, generator=gen)) is None


@needs_kernel
def test_each_row_computes_the_same_in_any_batch():
    gen = torch.Generator().manual_seed(11)
    groups = quantize_groups(torch.randn(203, 576, generator=gen) * 0.05)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(8, 576, generator=gen) * 3).to(dtype)
        full = KERNEL(x, *groups)
        for m in range(1, 9):
            assert torch.equal(KERNEL(x[:m].contiguous(), *groups), full[:m]), m
            assert torch.equal(KERNEL(x[m - 1:m].contiguous(), *groups), full[m - 1:m]), m
            assert torch.equal(KERNEL(x[8 - m:].contiguous(), *groups), full[8 - m:]), m


@needs_kernel
def test_rows_that_are_not_whole_groups_are_refused():
    groups = quantize_groups(torch.randn(8, 64))
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 48), groups[0][:, :24].contiguous(), groups[1][:, :1].contiguous(),
               groups[2][:, :1].contiguous())
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 64).half(), *groups)
    with pytest.raises(ValueError, match="int4 activations"):
        load_int4_kernel(activations="int4")


PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three primary colors:", "Water boils at", "The quick brown fox")
STEPS = 24


@needs_kernel
def test_bundled_model_greedy_agrees_with_transformers():
    """The engine in bfloat16 with int8 activations against transformers (bfloat16, on the same
    dequantized weights): every engine token within transformers' top 5 up to the first
    divergence, and at least 60% of the tokens before a first divergence (measured at 32 tokens
    a prompt: 128/192 int8, 151/192 with float activations)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int4"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20, profile_at_start=False, int4_activations="int8"))
    assert all(isinstance(layer.down, Int4Projection) and layer.down.kernel.activations == "int8"
               for layer in engine.model.spec.layers)
    ref, tok = loaded.hf_model, loaded.tokenizer
    agreed = 0
    for text in PROMPTS:
        ids = tok(text)["input_ids"]
        ours = run_alone(engine, ids, Sampling(max_tokens=STEPS, temperature=0, ignore_eos=True))
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=2,
                               output_logits=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(ids):].tolist()
        for t in range(STEPS):
            assert ours[t] in out.logits[t][0].float().topk(5).indices.tolist(), (text, t)
            if ours[t] != theirs[t]:
                break
            agreed += 1
    assert agreed >= 0.6 * STEPS * len(PROMPTS), agreed
