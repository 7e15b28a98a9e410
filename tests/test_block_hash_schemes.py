"""The block hash schemes: xxh3-128 chains like sha256 (deterministic, prefix-stable, salted),
with its own keys: the scheme is part of the model id, so the two never share a key."""

from __future__ import annotations

import pytest

from mooncake.blocks import extend_chain, hash_blocks, root_hash, scheme_model_id
from mooncake.config import ModelConfig

TOKENS = list(range(1000, 1100))


def test_xxh3_chain_is_deterministic_prefix_stable_and_extendable():
    mid = scheme_model_id("m@abc/bfloat16", "xxh3_128")
    assert mid == "m@abc/bfloat16+xxh3_128"
    chain = hash_blocks(TOKENS, 16, mid)
    assert len(chain) == 6 and {len(h) for h in chain} == {16}
    assert hash_blocks(TOKENS, 16, mid) == chain
    assert hash_blocks(TOKENS[:48], 16, mid) == chain[:3]
    assert chain[:2] + extend_chain(chain[1], TOKENS[32:], 16) == chain  # a chain continues in its scheme
    assert hash_blocks(TOKENS, 16, mid, "tenant") != chain
    assert hash_blocks(TOKENS[:15] + [7] + TOKENS[16:], 16, mid)[1] != chain[1]  # a change reaches later blocks


def test_schemes_never_share_a_key():
    sha = hash_blocks(TOKENS, 16, "m@abc/bfloat16")
    xxh = hash_blocks(TOKENS, 16, scheme_model_id("m@abc/bfloat16", "xxh3_128"))
    assert {len(h) for h in sha} == {32} and not set(sha) & set(xxh)
    assert len(root_hash(scheme_model_id("m", "sha256"))) == 32


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="unknown block hash scheme 'md5'"):
        scheme_model_id("m", "md5")
    with pytest.raises(ValueError):
        ModelConfig(block_hash="md5")


def test_loaded_model_id_names_the_scheme(loaded_model):
    from mooncake.engine import load_model

    xxh = load_model(ModelConfig(device="cpu", dtype="float32", block_hash="xxh3_128"))
    assert xxh.model_id == loaded_model.model_id + "+xxh3_128"


def test_conductor_refuses_an_engine_of_another_scheme_or_quantization():
    from mooncake import protocol as P
    from mooncake.conductor.expected_model import ExpectedModel

    shape = (30, 2, 3, 16, 64)
    want = ExpectedModel("m@0123456789abcdef", None, 16, shape, "+xxh3_128")

    def facts(model_id: str) -> P.ModelFacts:
        return P.ModelFacts(model_id=model_id, block_tokens=16, max_model_len=2048, vocab_size=49152,
                            block_shape=shape)

    assert want.problem(facts("m@0123456789abcdef/bfloat16+xxh3_128")) is None
    assert "block hash" in want.problem(facts("m@0123456789abcdef/bfloat16"))
    assert "block hash" in want.problem(facts("m@0123456789abcdef/bfloat16-int8+xxh3_128"))
    plain = ExpectedModel("m@0123456789abcdef", "bfloat16", 16, shape)
    assert plain.problem(facts("m@0123456789abcdef/bfloat16")) is None
    assert "block hash" in plain.problem(facts("m@0123456789abcdef/bfloat16+xxh3_128"))


def test_chains_are_pinned():
    """The keys outlive processes (LMDB files, peers on other versions): a change in how a
    chain is computed must show here, not as silent misses in every store."""
    sha = hash_blocks(list(range(40)), 16, "SmolLM2-135M-Instruct")
    xxh = hash_blocks(list(range(40)), 16, scheme_model_id("SmolLM2-135M-Instruct", "xxh3_128"), cache_salt="t")
    assert [h.hex()[:16] for h in sha] == ["03cf2d8be14e235f", "1c25a1aab4c62804"]
    assert [h.hex()[:16] for h in xxh] == ["ac3f8c934df3f3b1", "d78b38270e4864a8"]
