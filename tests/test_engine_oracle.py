"""The engine's forward against transformers: greedy tokens, logits, chunking, batching."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.protocol import Sampling

GREEDY = Sampling(max_tokens=32, temperature=0)
PARAGRAPH = ("The Mooncake serving system separates the prefill and decode phases of large language "
             "model inference and keeps a cache of attention keys and values in a tiered store. ")


def chat(tok, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def prompts(tok) -> dict[str, list[int]]:
    long_ids = tok(PARAGRAPH * 60)["input_ids"][:1500]
    return {
        "plain_short": tok("Once upon a time")["input_ids"],
        "plain_code": tok("def fibonacci(n):\n    ")["input_ids"],
        "chat_short": chat(tok, "What is the capital of France?"),
        "chat_medium": chat(tok, "Write a haiku about autumn leaves and explain its structure."),
        "plain_long": long_ids,
        "chat_long": chat(tok, "Summarize this text:\n" + tok.decode(long_ids[:1480])),
    }


def run(engine: Engine, ids: list[int], sampling: Sampling = GREEDY, **kw) -> list[int]:
    seq = engine.add_sequence("r", ids, sampling, **kw)
    assert seq is not None
    step = engine.prefill(seq)
    while not step.done:
        step = engine.prefill(seq)
    while not seq.finished:
        engine.decode_step([seq])
    engine.free(seq)
    return seq.tokens[len(ids):]


@pytest.fixture(scope="module")
def engine(loaded_model):
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=256 << 20, prefill_chunk_tokens=512))


@pytest.fixture(scope="module")
def cases(loaded_model):
    return prompts(loaded_model.tokenizer)


@pytest.mark.parametrize("name", ["plain_short", "plain_code", "chat_short", "chat_medium", "chat_long"])
def test_greedy_matches_transformers_generate(engine, oracle_model, cases, name):
    ids = cases[name]
    with torch.no_grad():
        ref = oracle_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, pad_token_id=2)
    expected = ref[0, len(ids):].tolist()
    got = run(engine, ids)
    assert got == expected
    assert engine.stats()["used_blocks"] == 0


def test_prefill_logits_match_transformers(engine, oracle_model, cases):
    ids = cases["chat_medium"]
    seq = engine.add_sequence("l", ids, GREEDY)
    step = engine.prefill(seq)
    engine.free(seq)
    with torch.no_grad():
        ref = oracle_model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(step.logits, ref, atol=1e-3, rtol=1e-4)


def test_chunked_prefill_equals_unchunked(loaded_model, cases):
    ids = cases["plain_long"][:300]
    whole = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20, prefill_chunk_tokens=512))
    small = Engine(loaded_model, EngineConfig(kv_cache_bytes=32 << 20, prefill_chunk_tokens=40))
    a, b = whole.add_sequence("a", ids, GREEDY), small.add_sequence("b", ids, GREEDY)
    sa = whole.prefill(a)
    chunks, full = 0, []
    while True:
        sb = small.prefill(b)
        chunks += 1
        full += sb.new_full_blocks
        if sb.done:
            break
        # blocks become cached as soon as their chunk is computed
        assert small.cached_prefix(b.block_hashes) == len(b.block_hashes) == b.num_computed // 16
    assert chunks == 8 and full == list(range(300 // 16))
    torch.testing.assert_close(sa.logits, sb.logits, atol=1e-3, rtol=1e-4)
    assert sa.token == sb.token
    for _ in range(8):
        whole.decode_step([a])
        small.decode_step([b])
    assert a.tokens == b.tokens


def test_batched_decode_equals_single(engine, cases):
    """8 sequences of different lengths; half join late, they leave at different steps."""
    base = cases["plain_long"]
    lengths = [5, 17, 40, 64, 99, 130, 257, 400]
    prompts_ = [base[i * 7: i * 7 + n] for i, n in enumerate(lengths)]
    samplings = [Sampling(max_tokens=6 + i % 4 * 2, temperature=0, ignore_eos=True) for i in range(8)]
    alone = [run(engine, p, sp) for p, sp in zip(prompts_, samplings)]
    seqs = [engine.add_sequence("b%d" % i, p, sp) for i, (p, sp) in enumerate(zip(prompts_, samplings))]
    for s in seqs:
        engine.prefill(s)
    live, steps = seqs[:4], 0
    while live:
        outs = engine.decode_step(live)
        assert all(o.token is not None for o in outs)
        steps += 1
        live = [s for s in live if not s.finished]
        if steps == 3:
            live = seqs[4:] + live  # join between steps, in a different row order
    together = [s.tokens[len(p):] for s, p in zip(seqs, prompts_)]
    for s in seqs:
        engine.free(s)
    assert together == alone
