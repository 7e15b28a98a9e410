"""A GGUF's Q8_0 weights served as stored (int8 values, a float16 scale per block of 32): the
blocks read are the file's values, Q and K rows come in the order transformers' GGUF loader gives
them, the kernel computes the float reference to float32 accuracy with each row the same in any
batch, and the bundled model's tied lm_head (Q8_0 in the file) is served so, which brings its greedy output closer to that of its float reference."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.kernels.native import load_q8_kernel
from mooncake.engine.loading.gguf_blocks import q8_0_blocks, q8_0_tensor, unpermute_rows
from mooncake.engine.loading.loader import default_model_path
from mooncake.engine.model.int4 import Int4Projection
from mooncake.engine.model.int8 import Int8Projection
from mooncake.engine.model.q8 import Q8Projection, dequantize_q8, holds_q8
from mooncake.protocol import Sampling
from mooncake.testing.engine_run import run_alone

KERNEL = load_q8_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler or no AVX-512 VNNI here")
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def test_the_bundled_token_embd_blocks_are_the_files_values():
    reader = gguf.GGUFReader(str(default_model_path()))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type == Q8_0
    cols, rows = (int(s) for s in t.shape)
    q, d = q8_0_tensor(t.data, rows, cols)
    assert q.dtype == torch.int8 and q.shape == (49152, 576) and d.dtype == torch.float16 and d.shape == (49152, 18)
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).float()
    assert torch.equal(dequantize_q8(q, d), want)  # d * q in float32, exactly
    blocks = q8_0_blocks(default_model_path(), 9, 3)
    assert list(blocks) == ["lm_head"]  # the layers are Q4_1: none of them
    assert torch.equal(blocks["lm_head"][0], q) and torch.equal(blocks["lm_head"][1], d)


def test_q_and_k_rows_come_in_transformers_order(tmp_path):
    """A Llama-architecture GGUF's Q8_0 attn_q, attn_k, attn_v (grouped-query: 4 heads, 2 for K/V)
    fused into qkv: row for row the weights transformers' GGUF loader converts."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, kv_heads, head_dim, hidden = 4, 2, 8, 64
    gen = np.random.default_rng(0)
    parts = {"attn_q": heads * head_dim, "attn_k": kv_heads * head_dim, "attn_v": kv_heads * head_dim}
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    for name, rows in parts.items():
        w = gen.standard_normal((rows, hidden)).astype(np.float32)
        writer.add_tensor(f"blk.0.{name}.weight", gguf.quants.quantize(w, Q8_0), raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    processor = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "tiny.gguf")).tensors}
    want = torch.cat([torch.from_numpy(np.copy(processor.process(
        weights=gguf.quants.dequantize(tensors[f"blk.0.{n}.weight"].data, Q8_0), name=f"blk.0.{n}.weight").weights))
        for n in parts])
    blocks = q8_0_blocks(tmp_path / "tiny.gguf", heads, kv_heads)
    assert list(blocks) == ["layer 0 qkv"]
    assert torch.equal(dequantize_q8(*blocks["layer 0 qkv"]), want)
    rows = torch.arange(2 * heads * head_dim, dtype=torch.float32)[:, None].expand(-1, 3)
    assert torch.equal(unpermute_rows(rows, heads), torch.from_numpy(
        processor._reverse_permute_weights(rows.numpy(), heads, heads)))


def _blocks(N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    scale = (torch.rand(N, K // 32, generator=gen) * 0.02 + 1e-4).half()  # float16 scales, as stored
    return w8, scale


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
def test_kernel_computes_the_float_reference_to_float32_accuracy(rows):
    """Activations spanning 5 orders of magnitude, an output count that is not a multiple of the
    kernel's 4-row blocks; float32 in and out within 1e-5 of the float64 result (relative, or 1e-6
    of the largest output), bfloat16 the float32 result rounded."""
    w8, scale = _blocks(203, 1536, rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 1536, generator=gen) * torch.logspace(-3, 2, 1536)
    want = x.double() @ dequantize_q8(w8, scale).double().T
    got = KERNEL(x, w8, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, 203)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    xb = x.bfloat16()
    want_b = (xb.double() @ dequantize_q8(w8, scale).double().T).float().bfloat16()
    got_b = KERNEL(xb, w8, scale)
    assert got_b.dtype == torch.bfloat16 and (got_b != want_b).float().mean() < 0.01
    torch.testing.assert_close(got_b.float(), want_b.float(), rtol=8e-3, atol=1e-6 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_row_is_the_same_in_any_batch(dtype):
    """Speculative decoding verifies several tokens in one call: each row bit for bit what a call
    of that row alone gives, and what every smaller batch containing it gives."""
    w8, scale = _blocks(99, 576, 7)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(8)).to(dtype)
    five = KERNEL(x[:5].contiguous(), w8, scale)
    for m in range(5):
        assert torch.equal(KERNEL(x[m:m + 1].contiguous(), w8, scale)[0], five[m]), m
    seven = KERNEL(x, w8, scale)
    for rows in range(1, 8):
        assert torch.equal(KERNEL(x[:rows].contiguous(), w8, scale), seven[:rows]), rows


@needs_kernel
def test_kernel_refuses_what_it_cannot_compute():
    w8, scale = _blocks(8, 64, 0)
    with pytest.raises(ValueError, match="Q8_0 kernel takes"):
        KERNEL(torch.randn(1, 48), w8[:, :48].contiguous(), scale[:, :1].contiguous())  # not whole groups
    with pytest.raises(ValueError, match="Q8_0 kernel takes"):
        KERNEL(torch.randn(1, 64).half(), w8, scale)
    with pytest.raises(ValueError, match="Q8_0 kernel takes"):
        KERNEL(torch.randn(1, 64), w8, scale.float())
    with pytest.raises(ValueError, match="Q8_0 kernel takes"):
        KERNEL(torch.randn(64, 2).T, w8, scale)  # not contiguous


def test_projection_overwrites_the_weight_with_its_values_and_splits_fused_outputs():
    w8, scale = _blocks(96, 64, 3)
    weight = dequantize_q8(w8, scale).bfloat16()
    assert holds_q8(weight, w8, scale) and not holds_q8(weight + 1, w8, scale)
    assert not holds_q8(weight[:, :32], w8, scale)  # another shape
    weight.zero_()
    proj = Q8Projection(weight, None, [64, 16, 16], KERNEL, (w8, scale))
    assert torch.equal(weight, dequantize_q8(w8, scale).bfloat16())  # the float reference, in place
    for rows in (1, 3, 7, 8, 20):  # the kernel (where it runs: the exact values) below max_rows, the bf16 weight from there
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
        q, k, v = proj(x)
        exact = dequantize_q8(w8, scale) if rows < proj.max_rows and KERNEL is not None else weight.float()
        torch.testing.assert_close(torch.cat([q, k, v], -1).float(), x.float() @ exact.T, atol=0.02, rtol=0.02)


@pytest.fixture(scope="module")
def default_engines():
    """The default model (``quantization = "auto"``: int4 on the bundled Q4_1 file) with its Q8_0
    lm_head as stored, and as it was before (the converted weight rounded to int8 rows: no GGUF given)."""
    engines = {}
    for q8 in (True, False):
        loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16"))
        loaded = loaded if q8 else dataclasses.replace(loaded, gguf=None)
        engines[q8] = (loaded, Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20, profile_at_start=False)))
    return engines


def test_the_default_models_head_as_stored_is_the_files_q8_0_and_speculation_stays_on(default_engines):
    loaded, engine = default_engines[True]
    spec = engine.model.spec
    assert loaded.quantization == "int4" and loaded.gguf == default_model_path()
    assert isinstance(spec.head, Q8Projection)
    assert all(isinstance(p, Int4Projection) for layer in spec.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    reader = gguf.GGUFReader(str(default_model_path()))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).bfloat16()
    assert torch.equal(spec.head.weight, want) and torch.equal(engine.model.embed, want)  # tied: the same values
    if KERNEL is not None:
        assert spec.head.kernel is not None
        assert engine.model.verify_rows == default_engines[False][1].model.verify_rows == 7
    assert isinstance(default_engines[False][1].model.spec.head, Int8Projection)


def test_int8_serves_the_q8_0_head_as_stored_too():
    engine = Engine(load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int8")),
                    EngineConfig(kv_cache_bytes=8 << 20, profile_at_start=False))
    assert isinstance(engine.model.spec.head, Q8Projection)
    assert all(isinstance(layer.down, Int8Projection) for layer in engine.model.spec.layers)


def test_greedy_output_keeps_and_moves_toward_the_float_reference(default_engines):
    """32 greedy tokens: the same as with int8 rows where that head already agreed with the float
    reference (transformers on the file's own values), and as long an agreement with that
    reference everywhere, longer where the rounded head had left it."""
    greedy = Sampling(max_tokens=32, temperature=0, ignore_eos=True)
    loaded, engine = default_engines[True]
    before = default_engines[False][1]
    ref, tok = loaded.hf_model, loaded.tokenizer  # holds the served weights: the file's values
    gained = 0
    for text in ("def fibonacci(n):", "Once upon a time, in a small village,", "List three prime numbers:",
                 "Explain why the sky is blue."):
        ids = tok(text)["input_ids"]
        ours, old = run_alone(engine, ids, greedy), run_alone(before, ids, greedy)
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=2)
        theirs = out[0, len(ids):].tolist()

        def agreed(a: list[int]) -> int:
            return next((i for i, (x, y) in enumerate(zip(a, theirs)) if x != y), len(theirs))

        assert agreed(ours) >= agreed(old), text
        if agreed(old) == 32:
            assert ours == old, text
        gained += agreed(ours) - agreed(old)
    assert gained > 0


def test_speculation_with_the_q8_0_head_gives_the_same_output(default_engines):
    """Verify rows through the Q8_0 kernel: greedy output with n-gram drafts as without, in fewer steps
    for an answer that quotes its prompt."""
    loaded = default_engines[True][0]
    text = ("Repeat this paragraph exactly:\n\nThe old lighthouse stood at the edge of the cliff, its white paint "
            "peeling in the salty wind. Every evening the keeper climbed the spiral stairs and lit the great lamp.")
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    greedy = Sampling(max_tokens=60, temperature=0, ignore_eos=True)
    outs = {}
    for spec in ("off", "ngram"):
        engine = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20, speculative=spec, profile_at_start=False))
        assert isinstance(engine.model.spec.head, Q8Projection)
        outs[spec] = run_alone(engine, ids, greedy)
        if spec == "ngram" and KERNEL is not None:
            assert engine.speculation.drafter.counts.accepted_tokens > 0
    assert outs["ngram"] == outs["off"]


def test_in_float32_the_engine_is_token_exact_against_its_float_reference():
    """float32, int4 layers and the Q8_0 head as stored: the engine's greedy tokens are transformers'
    on the same (dequantized: the file's own) weights."""
    loaded = load_model(ModelConfig(device="cpu", dtype="float32", quantization="int4"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=32 << 20, int4_activations="float", profile_at_start=False))
    assert isinstance(engine.model.spec.head, Q8Projection)
    greedy = Sampling(max_tokens=16, temperature=0, ignore_eos=True)
    for text in ("The capital of France is", "def fibonacci(n):"):
        ids = loaded.tokenizer(text)["input_ids"]
        with torch.no_grad():
            out = loaded.hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                           max_new_tokens=16, do_sample=False, pad_token_id=2)
        theirs = out[0, len(ids):].tolist()
        assert len(theirs) >= 8 and run_alone(engine, ids, greedy)[:len(theirs)] == theirs, text


def test_a_mostly_q8_0_files_model_id_says_its_layers_are_served_as_stored(tmp_path):
    """Its layers' KV differs from what the same id meant when they were rounded to int8 rows: the id
    changes (``+q8_0``), so blocks a persistent store kept from then are never reused, and a conductor
    with ``quantization = "auto"`` still accepts an engine serving it."""
    from mooncake.conductor.expected_model import ExpectedModel
    from mooncake.engine.loading.loader import model_variant

    path = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_file_type(7)  # LLAMA_FTYPE_MOSTLY_Q8_0
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_variant(ModelConfig(path=str(path), quantization="int8")) == "-int8+q8_0"
    assert model_variant(ModelConfig(path=str(path), quantization="none")) == ""
    assert model_variant(ModelConfig(quantization="int4")) == "-int4"  # the bundled Q4_1 file: its head only
    shape = (30, 2, 3, 16, 64)
    auto = ExpectedModel("m@1", "bfloat16", 16, shape, "", any_quantization=True)
    facts = SimpleNamespace(model_id="m@1/bfloat16-int8+q8_0", block_tokens=16, block_shape=shape)
    assert auto.problem(facts) is None  # type: ignore[arg-type]
    pinned = ExpectedModel("m@1", "bfloat16", 16, shape, "-int8")  # a conductor that rounds to int8 rows
    assert "bfloat16-int8+q8_0" in (pinned.problem(facts) or "")  # type: ignore[arg-type]
