"""Sampling options through the engine on the real model: grammar, min_tokens, stop ids,
logprobs, penalties, seeds independent of the batch, bad values."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from mooncake.api.structured import schema_grammar
from mooncake.config import EngineConfig
from mooncake.engine import Engine, InvalidRequestError
from mooncake.engine import token_picker
from mooncake.engine.sampler import Row, sample
from mooncake.protocol import Sampling

PROMPT = "The three most important things about the moon are"


@pytest.fixture(scope="module")
def eng(loaded_model) -> Engine:
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=64 << 20))


@pytest.fixture(scope="module")
def ids(loaded_model) -> list[int]:
    return loaded_model.tokenizer(PROMPT)["input_ids"]


def run(eng: Engine, ids: list[int], **kw) -> list:
    """Generated tokens (with their step outputs) of one sequence, alone."""
    seq = eng.add_sequence("s", ids, Sampling(**kw))
    step = None
    while not seq.prefilled:
        step = eng.prefill(seq)
    outs = [step]
    while not seq.finished:
        outs.append(eng.decode_step([seq])[0])
    eng.free(seq)
    return outs


def test_json_schema_grammar_output_validates(eng, ids, loaded_model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}
    outs = run(eng, ids, max_tokens=60, temperature=0, grammar=schema_grammar(schema, "response_format"))
    text = loaded_model.tokenizer.decode([o.token for o in outs], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    assert outs[-1].finished == "stop"


def test_min_tokens_masks_stop_ids_until_reached(eng, ids):
    first = run(eng, ids, max_tokens=1, temperature=0)[0].token
    assert len(run(eng, ids, max_tokens=8, temperature=0, stop_token_ids=[first])) == 1
    held = run(eng, ids, max_tokens=8, temperature=0, stop_token_ids=[first], min_tokens=4)
    assert len(held) >= 4 and held[0].token != first


def test_logprobs_from_prefill_and_decode(eng, ids):
    outs = run(eng, ids, max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    for o in outs:
        assert o.logprob is not None and len(o.logprob.top_ids) == 3
        assert o.logprob.top_ids[0] == o.token and o.logprob.logprob == o.logprob.top_logprobs[0] <= 0


def test_penalties_change_greedy_output(eng, ids):
    plain = [o.token for o in run(eng, ids, max_tokens=24, temperature=0, ignore_eos=True)]
    penalized = [o.token for o in run(eng, ids, max_tokens=24, temperature=0, ignore_eos=True,
                                      frequency_penalty=2.0, presence_penalty=2.0)]
    assert penalized != plain
    assert max(penalized.count(t) for t in set(penalized)) <= max(plain.count(t) for t in set(plain))


def test_seeded_sequence_draws_the_same_in_any_batch(eng, ids, monkeypatch):
    """A seeded row draws from its own seed and position wherever it sits in a batch: each
    token it gets in a batch is the one it would draw alone from the same logits. (The logits
    themselves differ with the batch shape by float rounding, ~1e-5 here, which can move a draw
    that lands on a boundary of the distribution: so the same logits, not the same run.)"""
    alone = [o.token for o in run(eng, ids, max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)]
    assert [o.token for o in run(eng, ids, max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)] == alone
    seen: list[tuple[torch.Tensor, list[Row], list[int]]] = []

    def recording(logits, rows, mask=None):
        out = sample(logits, rows, mask)
        seen.append((logits.clone(), rows, out.tokens))
        return out

    monkeypatch.setattr(token_picker, "sample", recording)
    a = eng.add_sequence("a", ids, Sampling(max_tokens=8, temperature=1.0, seed=42, ignore_eos=True))
    b = eng.add_sequence("b", ids[:5], Sampling(max_tokens=8, temperature=0.7, ignore_eos=True, presence_penalty=1))
    toks = [eng.prefill(a).token]
    eng.prefill(b)
    while not a.finished:
        toks.append(eng.decode_step([b, a])[1].token)
    eng.free(a)
    eng.free(b)
    assert toks[0] == alone[0]  # the prefill is the same computation alone
    batched = [(logits, rows, tokens) for logits, rows, tokens in seen if len(rows) == 2]
    assert len(batched) == 7
    for position, (logits, rows, tokens) in enumerate(batched, start=1):
        row = rows[1]
        assert row.seed == 42 and row.num_generated == position  # its own seed and position
        assert sample(logits[1:], [row]).tokens == [tokens[1]]  # alone, from the same logits


@pytest.mark.parametrize("sampling,param", [
    (Sampling(min_p=1.5), "min_p"), (Sampling(presence_penalty=3), "presence_penalty"),
    (Sampling(repetition_penalty=0), "repetition_penalty"), (Sampling(logprobs=21), "logprobs"),
    (Sampling(logit_bias={10**6: 1.0}), "logit_bias"), (Sampling(stop_token_ids=[-1]), "stop_token_ids"),
    (Sampling(min_tokens=-1), "min_tokens"), (Sampling(grammar='{"grammars": 1}'), "response_format"),
])
def test_bad_sampling_values_name_the_option(eng, ids, sampling, param):
    free = eng.stats()["free_blocks"]
    with pytest.raises(InvalidRequestError) as e:
        eng.add_sequence("x", ids, sampling)
    assert e.value.param == param
    assert eng.stats()["free_blocks"] == free
