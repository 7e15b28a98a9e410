"""The decode workspace as a batch grows one sequence at a time (sequences joining a running batch
as their KV lands): it is reallocated log2(B) times, not once per new row, and a reallocation keeps
what its rows held, so a sequence already decoding is not gathered from the pool again. Tokens are
the same as each sequence decoded alone."""

from __future__ import annotations

import pytest

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.protocol import Sampling

GREEDY = Sampling(max_tokens=64, temperature=0, ignore_eos=True)
TEXTS = [f"Request {i}: the batch grows by one sequence at a time, and each keeps decoding. " * (2 + i)
         for i in range(5)]


def engine(loaded_model) -> Engine:
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=64 * 1024 * 1024, prefill_chunk_tokens=512, threads=1))


def prefilled(eng: Engine, rid: str, ids: list[int]):
    seq = eng.add_sequence(rid, ids, GREEDY)
    while not eng.prefill(seq).done:
        pass
    return seq


@pytest.fixture(scope="module")
def prompts(loaded_model) -> list[list[int]]:
    return [loaded_model.tokenizer(t)["input_ids"] for t in TEXTS]


def test_a_growing_batch_reallocates_log2_times_and_gathers_each_sequence_once(loaded_model, prompts):
    alone = []
    for i, ids in enumerate(prompts):  # the reference: each sequence decoded on its own
        eng = engine(loaded_model)
        seq = prefilled(eng, f"r{i}", ids)
        for _ in range(len(prompts) - i + 2):
            eng.decode_step([seq])
        alone.append(list(seq.tokens))

    eng = engine(loaded_model)
    model = eng.model
    batch = []
    for i, ids in enumerate(prompts):  # one more sequence joins before each step
        batch.append(prefilled(eng, f"r{i}", ids))
        eng.decode_step(batch)
    for _ in range(2):
        eng.decode_step(batch)
    assert [list(s.tokens) for s in batch] == alone
    assert model.row_gathers == len(prompts)  # each row gathered once, at its sequence's first step
    assert model._dws.shape[2] == 8  # rows 1, 2, 4, 8: five sequences, four row reallocations
    assert model.workspace_grows == 4  # (the positions fit from the first: no growth for them)
