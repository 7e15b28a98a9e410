"""The CUDA paths, where a GPU is present (skipped elsewhere, so in CI): the engine on cuda
against transformers on the same GPU and weights, a cache hit on cuda, and the store's device
tier in GPU memory demoting to pinned host memory and to LMDB and coming back intact."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.protocol import Sampling
from mooncake.tiers.memory import DeviceTier, DramTier
from mooncake.tiers.lmdb_tier import LmdbTier
from mooncake.tiers.tiered import TieredStore

from oracle import greedy
from test_engine_oracle import prompts, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 24
GREEDY = Sampling(max_tokens=STEPS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_float32():
    loaded = load_model(ModelConfig(device="cuda", dtype="float32"))
    assert next(loaded.hf_model.parameters()).device.type == "cuda"
    return loaded


@pytest.mark.parametrize("name", ["plain_short", "chat_short", "chat_medium", "plain_long"])
def test_float32_engine_on_cuda_matches_transformers_on_cuda(cuda_float32, name):
    """Greedy to the step, end-of-sequence included (``oracle.greedy``: no generate processors)."""
    ids = prompts(cuda_float32.tokenizer)[name]
    engine = Engine(cuda_float32, EngineConfig(kv_cache_bytes=256 << 20, prefill_chunk_tokens=512))
    assert run(engine, ids, GREEDY) == greedy(cuda_float32.hf_model, ids, STEPS)


def test_a_cache_hit_on_cuda_gives_the_same_tokens_and_a_batch_decodes_on_cuda(cuda_float32):
    engine = Engine(cuda_float32, EngineConfig(kv_cache_bytes=256 << 20, prefill_chunk_tokens=256))
    ids = prompts(cuda_float32.tokenizer)["plain_long"]
    cold = run(engine, ids, GREEDY)
    assert engine.cached_prefix(engine.hashes(ids)) > 0
    assert run(engine, ids, GREEDY) == cold
    seqs = [engine.add_sequence(f"b{i}", ids[: 200 + 37 * i], GREEDY) for i in range(4)]
    for s in seqs:
        while not s.prefilled:
            engine.prefill(s)
    while not all(s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])
    assert all(len(s.tokens) == 200 + 37 * i + STEPS for i, s in enumerate(seqs))
    for s in seqs:
        engine.free(s)


def test_device_tier_in_gpu_memory_demotes_to_pinned_dram_and_lmdb_and_back(tmp_path):
    block = 4096
    blocks = [torch.randn(block // 4) for _ in range(6)]
    store = TieredStore([DeviceTier(2 * block), DramTier(2 * block), LmdbTier(tmp_path / "lmdb", 2 * block)])
    for i, t in enumerate(blocks):
        assert store.put_many([bytes([i]) * 32], [t.cuda()]) == 1
    assert [store.tier_of(bytes([i]) * 32) for i in range(6)] == ["lmdb", "lmdb", "dram", "dram", "device", "device"]
    on_gpu = store.get_many([bytes([5]) * 32], count=False)[0][1].tensor
    in_dram = store.get_many([bytes([3]) * 32], count=False)[0][1].tensor
    assert on_gpu.device.type == "cuda" and in_dram.device.type == "cpu" and in_dram.is_pinned()
    got = store.get_many([bytes([i]) * 32 for i in range(6)])  # a hit promotes back towards the GPU
    assert [k[0] for k, _ in got] == list(range(6))
    for (_, b), t in zip(got, blocks):
        assert torch.equal(b.tensor.cpu(), t)
    store.check_invariants()
    store.close()
