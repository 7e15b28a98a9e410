"""A colocated instance's steps on the engine, as ``roles/colocated.py`` makes them (a decode step,
then prompt chunks within what the batch leaves of the budget): the same greedy tokens as
transformers, with cached prefixes and a budget smaller than a prompt (its chunks spread over
several steps while others decode)."""

from __future__ import annotations

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.protocol import Sampling
from tests.oracle import greedy

N = 12
GREEDY = Sampling(max_tokens=N, temperature=0, ignore_eos=True)


def step(engine: Engine, decoding: list, prefilling: list, budget: int) -> tuple[list, list]:
    outs = engine.decode_step(decoding) if decoding else []
    chunks = engine.prefill_many(prefilling, None, max(engine.block_tokens, budget - len(decoding))) \
        if prefilling else []
    return outs, chunks


def test_mixed_steps_equal_transformers(loaded_model, oracle_model):
    tok = loaded_model.tokenizer
    doc = tok("Paged attention keeps keys and values in fixed-size blocks. " * 5)["input_ids"]
    prompts = [tok("Once upon a time")["input_ids"], doc[:40], doc, doc[:33] + tok(" and then")["input_ids"],
               tok("The capital of France is")["input_ids"]]
    engine = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20, prefill_chunk_tokens=64))
    seqs = [engine.add_sequence("r%d" % i, p, GREEDY) for i, p in enumerate(prompts[:2])]
    while not all(s.prefilled for s in seqs):
        engine.prefill_many([s for s in seqs if not s.prefilled])
    steps = 0
    for i, p in enumerate(prompts[2:], start=2):  # the others join one by one while the first decode
        seqs.append(engine.add_sequence("r%d" % i, p, GREEDY))
    assert seqs[3].num_cached_tokens == 32  # two blocks of doc[:40], computed above
    firsts: dict[str, int] = {}
    while any(not s.finished for s in seqs):
        decoding = [s for s in seqs if s.prefilled and not s.finished]
        prefilling = [s for s in seqs if not s.prefilled]
        outs, chunks = step(engine, decoding, prefilling, budget=40)
        steps += 1
        assert len(outs) == len(decoding) and all(o.token is not None for o in outs)
        assert all(s.num_computed - (len(s.tokens) - 1 if s.prefilled else 0) >= 0 for s in prefilling)
        for s, c in zip(prefilling, chunks):
            if c.done:
                firsts[s.req_id] = c.token
    assert steps > len(doc) // 40  # the long prompt took several steps, others decoding beside it
    for s, p in zip(seqs, prompts):
        assert s.tokens[len(p):] == greedy(oracle_model, p, N), s.req_id
        assert s.req_id in firsts or s.req_id in ("r0", "r1")


def test_a_prompt_moves_by_a_block_at_least(loaded_model):
    """A budget below a block still moves a prompt by a block; alone, it takes the whole budget."""
    tok = loaded_model.tokenizer
    engine = Engine(loaded_model, EngineConfig(kv_cache_bytes=16 << 20, prefill_chunk_tokens=64))
    a = engine.add_sequence("a", tok("Hello there, how are you? " * 4)["input_ids"], GREEDY)
    outs, chunks = step(engine, [], [a], budget=4)
    assert outs == [] and chunks[0].done is False and a.num_computed == 16  # at least a block
    while not a.prefilled:
        step(engine, [], [a], budget=64)
    outs, chunks = step(engine, [a], [], budget=64)
    assert chunks == [] and outs[0].token is not None
