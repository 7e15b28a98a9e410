"""Chunked pipeline parallelism in the engine (issue 12): a prompt computed chunk by chunk through
2 or 3 stages (layer ranges, hidden states handed on) gives the KV, logits and first token of the
one-instance prefill; each stage writes only its own layers."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.protocol import Sampling
from mooncake.sched.pipeline import stage_layers

GREEDY = Sampling(max_tokens=4, temperature=0, ignore_eos=True)
TEXT = "Stages of a pipeline compute their layers while the next chunk enters the first stage. " * 12
BLOCK = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2 block, float32


@pytest.fixture(scope="module")
def eng(loaded_model) -> Engine:
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=128 * BLOCK, prefill_chunk_tokens=40, threads=1))


@pytest.fixture(scope="module")
def ids(loaded_model) -> list[int]:
    return loaded_model.tokenizer(TEXT)["input_ids"][:150]


def test_stage_layers_split_evenly():
    assert stage_layers(30, 2) == [(0, 15), (15, 30)]
    assert stage_layers(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert stage_layers(7, 3) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ValueError):
        stage_layers(2, 3)


def _through_stages(eng: Engine, ids: list[int], stages: int, cached_blocks: int = 0):
    """Each stage its own sequence on the same engine (as on its own instance); chunks flow through."""
    hashes = eng.hashes(ids)
    seqs = [eng.add_sequence(f"s{i}", ids, GREEDY, hashes=hashes, max_cached_blocks=cached_blocks)
            for i in range(stages)]
    assert all(s.num_cached_tokens == cached_blocks * eng.block_tokens for s in seqs)
    layers = stage_layers(eng.block_shape[0], stages)
    while True:
        end = min(len(ids), seqs[0].num_computed + eng.chunk_tokens)
        hidden = None
        for seq, lr in zip(seqs, layers):
            step, hidden = eng.prefill_stage(seq, lr, end, hidden)
        if step.done:
            return seqs, step, layers


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_equal_one_instance(eng, ids, stages):
    one = eng.add_sequence("one", ids, GREEDY, max_cached_blocks=0)
    while not (ref := eng.prefill(one)).done:
        pass
    ref_kv = eng.kv.export_sequence(one).clone()
    seqs, step, layers = _through_stages(eng, ids, stages)
    assert step.token == ref.token
    torch.testing.assert_close(step.logits, ref.logits, rtol=1e-4, atol=1e-4)
    for seq, (lo, hi) in zip(seqs, layers):
        torch.testing.assert_close(eng.kv.export_sequence(seq)[:, lo:hi], ref_kv[:, lo:hi], rtol=1e-4, atol=1e-5)
    for s in [one, *seqs]:
        eng.free(s)


def test_stages_after_a_cached_prefix(eng, ids):
    one = eng.add_sequence("warm", ids[:100], GREEDY)  # leaves 6 keyed blocks in the cache
    while not eng.prefill(one).done:
        pass
    eng.free(one)
    ref = eng.add_sequence("ref", ids, GREEDY, max_cached_blocks=0)
    while not (want := eng.prefill(ref)).done:
        pass
    seqs, step, _ = _through_stages(eng, ids, 3, cached_blocks=6)
    assert step.token == want.token
    torch.testing.assert_close(step.logits, want.logits, rtol=1e-4, atol=1e-4)
    for s in [ref, *seqs]:
        eng.free(s)


def test_stage_blocks_are_never_reused(eng, ids):
    before = eng.stats()["prefix_blocks"]
    seqs, _, _ = _through_stages(eng, ids[:90], 2)
    for s in seqs:
        eng.free(s)
    assert eng.stats()["prefix_blocks"] == before  # half-filled blocks never enter the prefix cache


def test_bad_stage_input_is_refused(eng, ids):
    seq = eng.add_sequence("bad", ids, GREEDY, max_cached_blocks=0)
    with pytest.raises(ValueError, match="hidden states"):
        eng.prefill_stage(seq, (15, 30), 40, None)
    with pytest.raises(ValueError, match="hidden states"):
        eng.prefill_stage(seq, (15, 30), 40, torch.zeros(39, 576))
    with pytest.raises(ValueError, match="do not fit"):
        eng.prefill_stage(seq, (0, 31), 40)
    with pytest.raises(ValueError, match="do not fit"):
        eng.prefill_stage(seq, (0, 15), 151)
    eng.free(seq)
