"""Weight-only int4 (groups of 32, a scale and an offset each): a Q4_1 grid comes back exactly,
the engine's kernel computes what the dequantized weights compute to float32 accuracy, and the
bundled model keeps its Q4_1 layers in int4 (its float32 exactness against transformers is
tested with int8's, in ``test_engine_int8.py``)."""

from __future__ import annotations

import pytest
import torch

from mooncake.conductor.expected_model import ExpectedModel
from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, ModelLoadError, load_model
from mooncake.engine.kernels.native import load_int4_kernel
from mooncake.engine.model.int4 import INT4_MAX_ROWS, Int4Projection, dequantize_groups, int4_groups, quantize_groups
from mooncake.engine.model.q8 import Q8Projection
from mooncake.engine.model.quantize import quantize_spec
from mooncake.protocol import ModelFacts

KERNEL = load_int4_kernel(activations="float")  # the float path (int8 activations: test_int4_vnni.py)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX-512 VNNI here")


def test_groups_of_32_round_to_16_levels_between_their_least_and_greatest_value():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=gen) * torch.linspace(0.01, 3, 24)[:, None]
    packed, scale, zero = quantize_groups(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 48) and scale.shape == zero.shape == (24, 3)
    back = dequantize_groups(packed, scale, zero)
    groups = w.reshape(24, 3, 32)
    torch.testing.assert_close(zero, groups.amin(-1))
    assert torch.allclose(back, w, atol=float(scale.max()) / 2 + 1e-6)
    assert ((back - w).abs().reshape(24, 3, 32) <= scale[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_groups(torch.randn(4, 48))


def test_a_q4_1_grid_comes_back_exactly():
    """Values d * q + m (q in 0..15, each group using 0 and 15, as llama.cpp writes Q4_1) are
    the file's own: quantizing them again changes none."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (16, 4, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(16, 4, 1, generator=gen) * 0.01 + 1e-3
    m = -torch.rand(16, 4, 1, generator=gen) * 0.05
    w = (q * d + m).reshape(16, 128)
    packed, scale, zero = quantize_groups(w)
    torch.testing.assert_close(dequantize_groups(packed, scale, zero), w, rtol=0, atol=1e-6)
    assert int4_groups(w) is not None and int4_groups(w.bfloat16()) is not None  # the serving dtype's rounding too
    assert int4_groups(w, chunk_rows=5) is not None
    torch.testing.assert_close(dequantize_groups(*int4_groups(w, chunk_rows=5)), w, rtol=0, atol=1e-6)
    assert int4_groups(torch.randn(16, 128, generator=gen)) is None  # full precision: between levels
    assert int4_groups(w[:, :48]) is None  # rows that are not whole groups


def test_groups_far_from_zero_still_come_back_in_bfloat16():
    """A group whose values sit far from zero (offset ≫ step) moves further when rounded to
    bfloat16; it is still on its grid, and a full-precision one there still is not."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 8, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(64, 8, 1, generator=gen) * 1e-3 + 2e-4
    m = 0.05 + torch.rand(64, 8, 1, generator=gen) * 0.1  # 50-1,500 steps from zero
    w = (q * d + m).reshape(64, 256)
    assert int4_groups(w.bfloat16()) is not None
    off_grid = w + (torch.rand(64, 256, generator=gen) - 0.5) * d.repeat_interleave(32, 1).reshape(64, 256)
    assert int4_groups(off_grid) is None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_own_kernel_computes_the_float_reference_to_float32_accuracy(rows):
    """Activations spanning 5 orders of magnitude, an output count that is not a multiple of
    the kernel's 4-row blocks, the float32 and the bfloat16 path."""
    gen = torch.Generator().manual_seed(rows)
    packed, scale, zero = quantize_groups(torch.randn(203, 1536, generator=gen) * 0.05)
    w = dequantize_groups(packed, scale, zero).double()
    x = torch.randn(rows, 1536, generator=gen) * torch.logspace(-3, 2, 1536)
    want = x.double() @ w.T
    got = KERNEL(x, packed, scale, zero)
    assert got.dtype == torch.float32 and got.shape == (rows, 203)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    xb = x.bfloat16()
    want_b = (xb.double() @ w.T).float().bfloat16()
    got_b = KERNEL(xb, packed, scale, zero)
    assert got_b.dtype == torch.bfloat16
    torch.testing.assert_close(got_b.float(), want_b.float(), rtol=8e-3, atol=1e-6 * float(want.abs().max()))


@needs_kernel
def test_own_kernel_reads_each_weight_as_the_float_reference_holds_it_bit_for_bit():
    """One-hot rows of x pick single weights: in float32 each comes back exactly as torch
    dequantizes it (the kernel's multiply and add are each rounded, not fused); a weight matrix
    of fewer rows than a block (3) and rows of one group (32)."""
    gen = torch.Generator().manual_seed(4)
    for n, k in ((3, 32), (203, 96)):
        packed, scale, zero = quantize_groups(torch.randn(n, k, generator=gen) * 0.05)
        w = dequantize_groups(packed, scale, zero)
        for cols in (range(0, k, 7), range(k - 5, k)):
            x = torch.zeros(len(cols), k)
            x[torch.arange(len(cols)), list(cols)] = 1.0
            assert torch.equal(KERNEL(x, packed, scale, zero), w[:, list(cols)].T.contiguous())


@needs_kernel
def test_own_kernel_refuses_what_it_cannot_compute():
    packed, scale, zero = quantize_groups(torch.randn(8, 64))
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 64).half(), packed, scale, zero)  # a dtype it would misread
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(64, 2).T, packed, scale, zero)  # not contiguous
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 64), packed, scale.bfloat16(), zero)
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 96), packed, scale, zero)  # x's row longer than the weight's
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 64), packed.view(torch.int8), scale, zero)
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 64), packed, scale, zero[:4])
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(1, 64), packed.flatten(), scale, zero)
    with pytest.raises(ValueError, match="int4 kernel takes"):
        KERNEL(torch.randn(0, 64), packed, scale, zero)


def test_an_unknown_scheme_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="int5"):
        quantize_spec(None, scheme="int5")  # type: ignore[arg-type]


def test_the_conductor_takes_one_scheme_suffix_under_auto_not_two():
    auto = ExpectedModel("m@0123456789abcdef", None, 16, (30, 2, 3, 16, 64), "", any_quantization=True)
    facts = lambda dtype: ModelFacts(model_id=f"m@0123456789abcdef/{dtype}", block_tokens=16,  # noqa: E731
                                     max_model_len=2048, vocab_size=49152, block_shape=(30, 2, 3, 16, 64))
    assert auto.problem(facts("bfloat16-int4")) is None
    assert auto.problem(facts("bfloat16-int4-int8")) is not None


def test_projection_matches_its_dequantized_weight_at_every_row_count():
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(96, 64, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    proj = Int4Projection(weight, bias, [64, 16, 16], KERNEL)
    assert torch.equal(weight, dequantize_groups(proj.w4, proj.scale, proj.zero).bfloat16())  # in place
    for rows in (1, 3, INT4_MAX_ROWS, 40):  # the kernel (where it runs) below the threshold
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        q, k, v = proj(x)
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(torch.cat([q, k, v], -1).float(), want, atol=0.05, rtol=0.02)


def test_int4_keeps_the_bundled_q4_1_layers_in_int4_and_its_q8_0_lm_head_as_stored():
    """The GGUF stores the layers' projections in Q4_1 and its embedding (the tied lm_head) in Q8_0:
    the layers come back exactly on int4 groups, the lm_head as the file stores it (``q8.py``)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int4"))
    spec = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20)).model.spec
    layers = [p for layer in spec.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(p, Int4Projection) for p in layers)
    assert isinstance(spec.head, Q8Projection)
