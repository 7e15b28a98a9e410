"""Layer-wise vs block-wise KV transfer in a real cluster (issue 12): a prompt of several
chunks, cold and after a cached prefix, gives transformers' greedy output either way.
Shapes: the pair only: KV moves from prefill to decode only there."""

from __future__ import annotations

import pytest

from mooncake.testing.api import complete, metric, metrics
from mooncake.testing.cluster import running_cluster, small_config

from oracle import greedy

pytestmark = pytest.mark.timeout(600)
TEXT = ("A pipeline of prefill stages keeps every node busy while the prompt flows through it; "
        "the key and value cache of each layer leaves as soon as that layer is done. ")


@pytest.fixture(scope="module", params=["layer", "block"])
def cluster(request, tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("data"))
    cfg.engine.kv_transfer = request.param
    cfg.engine.prefill_chunk_tokens = 48  # a 200-token prompt is 5 chunks
    with running_cluster(cfg=cfg) as c:
        yield c


@pytest.fixture(scope="module")
def prompt(loaded_model) -> list[int]:
    return loaded_model.tokenizer(TEXT * 8)["input_ids"][:203]


def test_a_long_prompt_then_a_cached_prefix_match_transformers(cluster, oracle_model, loaded_model, prompt):
    def expected(ids: list[int]) -> str:
        return loaded_model.tokenizer.decode(greedy(oracle_model, ids, 10), skip_special_tokens=True)

    r = complete(cluster.url, prompt, max_tokens=10, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected(prompt)
    # a second prompt sharing the first 160 tokens: its prefix is reused, its rest computed in chunks
    other = prompt[:160] + prompt[20:60]
    r = complete(cluster.url, other, max_tokens=10, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 144
    assert r.json()["choices"][0]["text"] == expected(other)
    assert metric(metrics(cluster.url), "mooncake:kv_inflight_at_prefill_end_bytes_count") == 2
