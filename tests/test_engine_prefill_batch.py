"""Prefill of several sequences in one forward (``Engine.prefill_many``): the same greedy
output and last logits as one by one, with cached prefixes, a shared chunk budget and
sequences left waiting for budget."""

from __future__ import annotations

import time

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.protocol import Sampling

GREEDY = Sampling(max_tokens=8, temperature=0, ignore_eos=True)


def _decode_rest(engine: Engine, seqs) -> list[list[int]]:
    while any(not s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])
    return [s.tokens for s in seqs]


@pytest.fixture(scope="module")
def prompts(loaded_model) -> list[list[int]]:
    tok = loaded_model.tokenizer
    long = tok("Paged attention keeps keys and values in fixed-size blocks. " * 6)["input_ids"]
    return [tok("Once upon a time")["input_ids"], long[:70], long[:33] + tok(" and then")["input_ids"],
            tok("The capital of France is")["input_ids"], long]


def test_packed_prefill_equals_one_by_one(loaded_model, prompts):
    alone = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20, prefill_chunk_tokens=64))
    together = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20, prefill_chunk_tokens=64))
    expected, first_logits = [], []
    for i, p in enumerate(prompts):
        s = alone.add_sequence("a%d" % i, p, GREEDY)
        while True:
            step = alone.prefill(s)
            if step.done:
                first_logits.append(step.logits)
                break
        expected += _decode_rest(alone, [s])
        alone.free(s)
    warm = together.add_sequence("w", prompts[1][:48], GREEDY)  # 3 cached blocks for prompts 1, 2, 4
    while not together.prefill_many([warm])[0].done:
        pass
    together.free(warm)
    seqs = [together.add_sequence("t%d" % i, p, GREEDY) for i, p in enumerate(prompts)]
    assert seqs[1].num_cached_tokens == 48 and seqs[4].num_cached_tokens == 48
    logits: dict[int, torch.Tensor] = {}
    calls = 0
    while any(not s.prefilled for s in seqs):
        waiting = [s for s in seqs if not s.prefilled]
        steps = together.prefill_many(waiting)
        calls += 1
        assert sum(s.num_computed for s in seqs) <= sum(len(p) for p in prompts)
        for s, step in zip(waiting, steps):
            if step.done:
                logits[seqs.index(s)] = step.logits
    # 64-token budget shared: fewer forwards than chunks one by one, some sequences waited
    assert calls < sum(-(-(len(p) - s.num_cached_tokens) // 64) for p, s in zip(prompts, seqs)) + len(prompts)
    assert _decode_rest(together, seqs) == expected
    for i, want in enumerate(first_logits):
        torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)
    for s in seqs:
        together.free(s)
    assert together.stats()["used_blocks"] == 0


def test_prefill_many_refuses_a_sequence_not_waiting(loaded_model, prompts):
    engine = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20))
    done = engine.add_sequence("d", prompts[0], GREEDY)
    engine.prefill(done)
    other = engine.add_sequence("o", prompts[3], GREEDY)
    with pytest.raises(RuntimeError, match="not waiting for prefill"):
        engine.prefill_many([other, done])
    assert other.num_computed == 0  # nothing computed


def test_packed_prefill_reports_each_sequence_its_share_of_the_forward(loaded_model, prompts):
    """A packed forward's time is split by tokens (the cost model learns from it), not
    reported whole to every sequence in it."""
    engine = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20, prefill_chunk_tokens=512))
    seqs = [engine.add_sequence("s%d" % i, p, GREEDY) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    steps = engine.prefill_many(seqs)
    wall = time.perf_counter() - t0
    assert all(st.done for st in steps)
    shares = [st.compute_s for st in steps]
    assert 0 < sum(shares) <= wall
    per_token = [c / len(p) for c, p in zip(shares, prompts)]
    assert max(per_token) == pytest.approx(min(per_token))
    for s in seqs:
        engine.free(s)
    alone = engine.add_sequence("a", prompts[0], GREEDY)
    t0 = time.perf_counter()
    step = engine.prefill_many([alone])[0]
    assert 0 < step.compute_s <= time.perf_counter() - t0
