"""N-gram speculative decoding (``engine/speculative.py``): drafts from the sequence's own n-grams,
verified in one forward, output identical to decoding without it -- greedy and seeded, alone and in
a batch, with penalties, min_tokens and logprobs, across block boundaries, after a preemption, with
no free block for drafts; opted out per request and for constrained output; off where a verify row
could differ from a decode step. In a cluster: in each shape ``mooncake serve`` gives, a request
speculated and one opted out get the same text, and the acceptance counters reach ``/metrics``."""

from __future__ import annotations

import logging

import httpx
import pytest

from mooncake.config import Config, EngineConfig, ModelConfig, MiB
from mooncake.engine import Engine, load_model
from mooncake.engine.speculative import NgramIndex, accepted
from mooncake.protocol import Sampling
from mooncake.testing.api import MODEL, metric, metrics
from mooncake.testing.cluster import SHAPES, start_cluster
from mooncake.testing.ports import free_port
from mooncake.testing.wait import wait_for

pytestmark = pytest.mark.timeout(900)

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. "
             "Every evening the keeper climbed the spiral stairs, lit the great lamp, and watched the ships "
             "pass safely through the narrow channel below.")


@pytest.fixture(scope="module")
def served_model():
    """The bundled model as ``mooncake serve`` loads it (bfloat16, its Q4_1 layers in int4): where
    speculation runs."""
    return load_model(ModelConfig())


def chat_ids(loaded, text: str) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


QUOTE = "Repeat this paragraph exactly, replacing 'keeper' with 'guard':\n\n" + PARAGRAPH
FREE = "Write a short poem about autumn leaves."


def engine(loaded, spec: str = "ngram", **kw) -> Engine:
    return Engine(loaded, EngineConfig(speculative=spec, kv_cache_bytes=kw.pop("kv_cache_bytes", 32 * MiB),
                                       profile_at_start=False, **kw))


def generate(eng: Engine, prompts: list[list[int]], samplings: list[Sampling]) -> tuple[list[list[int]], int, list]:
    """Each prompt's output, decoded in one batch; the number of decode steps and the logprobs."""
    seqs = [eng.add_sequence(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, samplings))]
    lps: list[list] = [[] for _ in seqs]
    for i, s in enumerate(seqs):
        while not s.prefilled:
            step = eng.prefill(s)
        lps[i].append(step.logprob)
    steps = 0
    while any(not s.finished for s in seqs):
        for i, out in enumerate(eng.decode_step([s for s in seqs if not s.finished])):
            lps[seqs.index(out.seq)] += out.logprobs
        steps += 1
    outs = [s.tokens[len(p):] for s, p in zip(seqs, prompts)]
    for s in seqs:
        eng.free(s)
    eng.blocks.check()
    assert len(eng.blocks.free) + eng.blocks.num_cached() == eng.num_blocks  # nothing held, nothing leaked
    return outs, steps, lps


def plain_and_prefilled(loaded, ids: list[int], sampling: Sampling):
    """The output without speculation, and a speculating engine holding the prompt, prefilled."""
    (plain,), _, _ = generate(engine(loaded, "off"), [ids], [sampling])
    eng = engine(loaded)
    seq = eng.add_sequence("r", ids, sampling)
    while not seq.prefilled:
        eng.prefill(seq)
    return plain, eng, seq


def test_ngram_index_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(range(1, 4), 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert index.propose(tokens, 3) == [7, 8, 5]  # "2 3" last seen before 7 (the 3-gram "5 2 3" never)
    tokens += [7]
    assert index.propose(tokens, 2) == [8, 5]  # "2 3 7": the longest suffix found
    assert index.propose([4, 5, 6], 3) == [] and NgramIndex(range(2, 3), 4).propose([5, 5], 4) == []
    assert accepted([7, 8, 5], [7, 8, 1, 4]) == 3 and accepted([7, 8], [6, 8, 9]) == 1 and accepted([], [3]) == 1
    assert accepted([7, 8], [7, 8, 2]) == 3


@pytest.mark.parametrize("prompt", [QUOTE, FREE])
def test_greedy_output_is_identical_and_a_quoting_answer_takes_fewer_steps(served_model, prompt):
    ids = chat_ids(served_model, prompt)
    sampling = [Sampling(max_tokens=80, temperature=0.0)]
    plain, plain_steps, _ = generate(engine(served_model, "off"), [ids], sampling)
    eng = engine(served_model)
    fast, steps, _ = generate(eng, [ids], sampling)
    assert fast == plain
    counts = eng.speculation.drafter.counts
    # one sequence: each verify step outputs its accepted drafts and one token more
    assert counts.emitted_tokens - counts.accepted_tokens == counts.verify_steps
    assert counts.accepted_tokens <= counts.draft_tokens
    if prompt is QUOTE:  # the answer copies the paragraph: most drafts are the model's own picks
        assert counts.accepted_tokens > counts.draft_tokens / 2 and steps < plain_steps * 0.6, (counts, steps)


def test_a_batch_with_seeds_penalties_min_tokens_logprobs_and_an_opt_out_is_identical(served_model):
    """Several sequences step together (drafting ones and others), each with its own sampler
    rows: a seeded sample, penalties over the drafts before a row, min_tokens counted per row,
    logprobs per output token, and one opted out."""
    prompts = [chat_ids(served_model, QUOTE), chat_ids(served_model, FREE), chat_ids(served_model, QUOTE + " ")]
    samplings = [Sampling(max_tokens=60, temperature=0.8, top_p=0.9, seed=11, logprobs=2),
                 Sampling(max_tokens=40, temperature=0.0, presence_penalty=0.5, repetition_penalty=1.1, min_tokens=30),
                 Sampling(max_tokens=50, temperature=0.0, speculative=False)]
    plain, _, plain_lps = generate(engine(served_model, "off"), prompts, samplings)
    eng = engine(served_model)
    fast, _, fast_lps = generate(eng, prompts, samplings)
    assert fast == plain and fast_lps == plain_lps
    assert eng.speculation.drafter.counts.verify_steps > 0


def test_a_preempted_sequence_resumes_with_the_same_output(served_model):
    """Preempted midway (its blocks freed, as a decode instance gives it back) and added again with its
    tokens so far, it drafts from an index rebuilt from them and ends as it would have."""
    ids = chat_ids(served_model, QUOTE)
    sampling = Sampling(max_tokens=60, temperature=0.0)
    plain, eng, seq = plain_and_prefilled(served_model, ids, sampling)
    for _ in range(4):
        eng.decode_step([seq])
    assert eng.speculation.drafter.counts.accepted_tokens > 0
    so_far = seq.tokens[len(ids):]
    eng.free(seq)
    (rest,), _, _ = generate(eng, [ids + so_far], [Sampling(max_tokens=60 - len(so_far), temperature=0.0)])
    assert so_far + rest == plain


def test_with_no_free_block_drafts_stay_in_the_blocks_held(served_model):
    """A pool with no free block left: drafts only fill the sequence's last block (never evicting
    a cached block, never failing the step); the output is the same."""
    ids = chat_ids(served_model, QUOTE)
    sampling = Sampling(max_tokens=40, temperature=0.0)
    plain, eng, seq = plain_and_prefilled(served_model, ids, sampling)
    hog = eng.blocks.allocate(len(eng.blocks.free))  # every free block taken
    while not seq.finished:
        held = len(seq.block_table)
        out = eng.decode_step([seq])[0]
        assert len(seq.block_table) <= held + 1 and not eng.blocks.free
        if out.token is None:  # its next position needs a block: one is made free (as a preemption would)
            assert seq.num_computed == held * eng.block_tokens
            eng.blocks.release([hog.pop()])
    assert seq.tokens[len(ids):] == plain and eng.speculation.drafter.counts.accepted_tokens > 0
    eng.blocks.release(hog)


def test_constrained_and_opted_out_requests_never_draft(served_model):
    ids = chat_ids(served_model, QUOTE)
    eng = engine(served_model)
    generate(eng, [ids], [Sampling(max_tokens=30, temperature=0.0, speculative=False)])
    generate(eng, [ids], [Sampling(max_tokens=30, temperature=0.0, grammar='{"grammars": [{"json_schema": {}}]}')])
    assert eng.speculation.drafter.counts.verify_steps == 0


def test_off_with_a_warning_where_a_verify_row_could_differ(loaded_model, caplog):
    """float32 serves unquantized weights through torch's matmuls, whose rows change with the row count."""
    with caplog.at_level(logging.WARNING):
        eng = engine(loaded_model)
    assert eng.speculation is None and "stays off" in caplog.text
    with pytest.raises(ValueError, match="speculative_ngram_max"):
        EngineConfig(speculative="ngram", speculative_ngram_min=4, speculative_ngram_max=2)


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tmp_path_factory):
    cfg = Config()
    cfg.engine.speculative = "ngram"
    cfg.engine.kv_cache_bytes = 96 * MiB
    cfg.engine.threads = 1
    cfg.engine.profile_at_start = False
    cfg.store.dram_bytes = 64 * MiB
    cfg.store.lmdb_bytes = 128 * MiB
    cfg.store.data_dir = str(tmp_path_factory.mktemp("data"))
    cfg.frontend.port = free_port()
    c = start_cluster(cfg=cfg, store=1, **SHAPES[request.param])
    yield c
    c.stop()


def test_served_output_is_the_same_speculated_or_not_and_the_counters_reach_metrics(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUOTE}], "max_tokens": 60, "temperature": 0}
    with httpx.Client(timeout=300) as client:
        texts = []
        for speculative in (False, True):
            r = client.post(cluster.url + "/v1/chat/completions", json={**body, "speculative": speculative})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[0] == texts[1] and texts[0]
        bad = client.post(cluster.url + "/v1/chat/completions", json={**body, "speculative": "yes"})
        assert bad.status_code == 400 and "speculative" in bad.text
    counter = lambda name: metric(metrics(cluster.url), f"mooncake:spec_decode_{name}_total")  # noqa: E731
    wait_for(lambda: counter("verify_steps") > 0, timeout_s=30)  # with the next heartbeat
    assert 0 < counter("accepted_tokens") <= counter("draft_tokens")
    assert counter("emitted_tokens") > counter("verify_steps")
