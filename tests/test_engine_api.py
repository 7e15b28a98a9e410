"""Engine API: prefix export/import, KV hand-off, pool exhaustion, bad input, seeds, load errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, InvalidRequestError, ModelLoadError, load_model
from mooncake.engine.model.rope import check_rope, inv_freq
from mooncake.protocol import Sampling

GREEDY = Sampling(max_tokens=12, temperature=0, ignore_eos=True)
TEXT = "Paged attention keeps keys and values in fixed-size blocks that many requests can share. " * 20


@pytest.fixture(scope="module")
def ids(loaded_model) -> list[int]:
    return loaded_model.tokenizer(TEXT)["input_ids"][:200]


def engine(loaded_model, blocks: int = 64, **kw) -> Engine:
    bb = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2 block, float32
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=max(blocks * bb, 1 << 20), **kw))


def generate(eng: Engine, seq, n: int) -> None:
    while not seq.prefilled:
        eng.prefill(seq)
    for _ in range(n):
        if seq.finished:
            break
        eng.decode_step([seq])


def test_prefix_export_import_skips_cached_prefix(loaded_model, ids):
    cold = engine(loaded_model)
    events = []
    cold.on_block_event = lambda kind, hs: events.append((kind, len(hs)))
    a = cold.add_sequence("a", ids, GREEDY)
    step_a = cold.prefill(a)
    assert events == [("stored", 200 // 16)]
    generate(cold, a, 11)
    hashes = cold.hashes(ids)
    kv = cold.kv.export_blocks(hashes)
    assert kv.shape == (12, *cold.block_shape)

    warm = engine(loaded_model)
    assert warm.kv.import_blocks(hashes, kv) == 12
    assert warm.stats()["cached_blocks"] == 12 and warm.cached_prefix(hashes) == 12
    b = warm.add_sequence("b", ids, GREEDY)
    assert b.num_cached_tokens == 192 and b.num_computed == 192
    step_b = warm.prefill(b)
    torch.testing.assert_close(step_b.logits, step_a.logits, atol=1e-3, rtol=0)
    generate(warm, b, 11)
    assert b.tokens == a.tokens
    # a different cache_salt does not hit
    assert warm.cached_prefix(warm.hashes(ids, cache_salt="tenant-2")) == 0
    # the whole prompt cached: one token is still computed
    c = warm.add_sequence("c", ids[:192], GREEDY)
    assert c.num_cached_tokens == 176
    for s in (a, b, c):
        (cold if s is a else warm).free(s)
    assert warm.stats()["used_blocks"] == 0 and warm.stats()["sequences"] == 0


def test_kv_handoff_prefill_to_decode(loaded_model, ids):
    pre, dec = engine(loaded_model), engine(loaded_model)
    ref = pre.add_sequence("r", ids[:150], GREEDY)
    generate(pre, ref, 11)
    p = pre.add_sequence("p", ids[:150], GREEDY)  # hits the prefix ref left cached
    step = pre.prefill(p)
    kv = pre.kv.export_sequence(p)
    assert kv.shape[0] == 10  # 150 tokens: 9 full blocks + partial tail
    tokens = p.tokens[:-1]
    d = dec.reserve("p", tokens, dec.hashes(tokens), dec.root(), GREEDY)
    assert d is not None and d.num_cached_tokens == 0 and len(d.block_table) == 10
    dec.kv.write_kv(d, 0, kv[:4])  # KV arrives in runs, as prefill streams it
    dec.kv.write_kv(d, 4, kv[4:])
    with pytest.raises(ValueError):
        dec.kv.write_kv(d, 9, kv[:2])  # past the reservation
    dec.begin_decoding(d, step.token)
    pre.free(p)
    assert dec.cached_prefix(dec.hashes(ids[:150])) == 9
    for _ in range(11):
        dec.decode_step([d])
    assert d.finished == "length" and d.tokens == ref.tokens
    # A second reservation of the same prompt shares the cached blocks: their KV is not rewritten.
    again = dec.reserve("q", tokens, dec.hashes(tokens), dec.root(), GREEDY)
    assert again.num_cached_tokens == 9 * 16 and again.block_table[:9] == d.block_table[:9]
    dec.kv.write_kv(again, 0, torch.zeros_like(kv))  # the shared blocks stay as they were
    assert torch.equal(dec.kv.export_sequence(d, 0, 9), kv[:9])
    dec.free(again)


def test_pool_exhaustion_is_a_clear_signal(loaded_model, ids):
    eng = engine(loaded_model, blocks=8)
    assert eng.num_blocks == 8
    a = eng.add_sequence("a", ids[:120], Sampling(max_tokens=50, temperature=0, ignore_eos=True))
    assert eng.add_sequence("b", ids[:40], GREEDY) is None
    assert eng.stats()["free_blocks"] == 0 and eng.stats()["sequences"] == 1
    eng.prefill(a)
    outs = [eng.decode_step([a])[0] for _ in range(8)]
    assert all(o.token is not None for o in outs)  # positions 120..127 fit in block 8
    before = list(a.tokens)
    o = eng.decode_step([a])[0]
    assert o.token is None and o.finished == "" and a.tokens == before
    assert eng.kv.import_blocks(eng.hashes(ids[:40]), torch.zeros(2, *eng.block_shape)) == 2  # present
    assert eng.kv.import_blocks(eng.hashes(ids[60:100]), torch.zeros(2, *eng.block_shape)) == 0  # no room
    eng.free(a)
    eng.free(a)  # idempotent
    st = eng.stats()
    assert st["free_blocks"] + st["cached_blocks"] + st["used_blocks"] == 8 and st["cached_blocks"] == 8
    eng.blocks.check()
    # evicting the cached blocks leaves a correct engine: same output as a fresh one
    other = ids[50:90]
    b = eng.add_sequence("b", other, GREEDY)
    generate(eng, b, 11)
    fresh = engine(loaded_model)
    c = fresh.add_sequence("c", other, GREEDY)
    generate(fresh, c, 11)
    assert b.tokens == c.tokens


def test_context_limit_finishes_with_length(loaded_model, ids):
    eng = engine(loaded_model, max_model_len=64)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_sequence("x", ids[:64], GREEDY)
    assert e.value.param == "prompt"
    s = eng.add_sequence("x", ids[:60], Sampling(max_tokens=100, temperature=0, ignore_eos=True))
    generate(eng, s, 100)
    assert s.finished == "length" and len(s.tokens) == 64


@pytest.mark.parametrize("tokens,sampling,param", [
    ([], Sampling(), "prompt"),
    ([1] * 9000, Sampling(), "prompt"),
    ([1, 49152], Sampling(), "prompt"),
    ([1, -1], Sampling(), "prompt"),
    ([1, 2], Sampling(max_tokens=0), "max_tokens"),
    ([1, 2], Sampling(temperature=-0.1), "temperature"),
    ([1, 2], Sampling(temperature=float("nan")), "temperature"),
    ([1, 2], Sampling(top_p=0.0), "top_p"),
    ([1, 2], Sampling(top_p=1.5), "top_p"),
    ([1, 2], Sampling(top_k=-1), "top_k"),
])
def test_bad_requests_are_rejected(loaded_model, tokens, sampling, param):
    eng = engine(loaded_model, blocks=2)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_sequence("x", tokens, sampling)
    assert e.value.param == param and str(e.value)
    assert eng.stats()["free_blocks"] == 2


def test_seed_reproducible_and_seeds_differ(loaded_model, ids):
    eng = engine(loaded_model)

    def sampled(seed, **kw):
        s = eng.add_sequence("s", ids[:30], Sampling(max_tokens=10, temperature=1.0, seed=seed,
                                                     ignore_eos=True, **kw))
        generate(eng, s, 10)
        eng.free(s)
        return s.tokens[30:]

    a, b, c = sampled(123, top_p=0.95), sampled(123, top_p=0.95), sampled(124, top_p=0.95)
    assert a == b and a != c
    greedy = eng.add_sequence("g", ids[:30], Sampling(max_tokens=10, temperature=0, ignore_eos=True))
    generate(eng, greedy, 10)
    assert sampled(5, top_k=1) == greedy.tokens[30:]
    assert sampled(6, top_p=1e-6) == greedy.tokens[30:]


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelConfig(path=str(tmp_path / "nope"), cache_dir=str(tmp_path)))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(ModelConfig(path=str(bad), cache_dir=str(tmp_path)))
    d = tmp_path / "gpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(ModelConfig(path=str(d), cache_dir=str(tmp_path)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(ModelConfig(path=str(empty), cache_dir=str(tmp_path)))


def test_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in ({"rope_type": "default", "rope_theta": 10000.0},
                   {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                   {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}):
        cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
        if params["rope_type"] == "default":  # transformers v5 computes it inline
            ref = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
        else:
            ref, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
            assert scale == 1.0
        torch.testing.assert_close(inv_freq(cfg, 64), ref.float())
    with pytest.raises(ModelLoadError, match="unsupported rope scaling type 'yarn'"):
        check_rope(SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 2.0}))


def test_prefix_caching_off_computes_every_prompt_in_full(loaded_model):
    from mooncake.config import EngineConfig, MiB
    from mooncake.engine import Engine
    from mooncake.protocol import Sampling

    eng = Engine(loaded_model, EngineConfig(kv_cache_bytes=64 * MiB, prefix_caching=False))
    prompt = list(range(100, 164))
    first = eng.add_sequence("a", prompt, Sampling(max_tokens=1, temperature=0))
    while not eng.prefill(first).done:
        pass
    eng.free(first)
    assert eng.cached_prefix(eng.hashes(prompt)) == 0
    again = eng.add_sequence("b", prompt, Sampling(max_tokens=1, temperature=0))
    assert again.num_cached_tokens == 0
    eng.free(again)
