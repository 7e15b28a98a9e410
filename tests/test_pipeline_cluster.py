"""Chunked pipeline parallelism in a real cluster (issue 12): 3 prefill instances, pipeline groups
of 2 or 3 stages. A long prompt goes through a group and gives transformers' greedy output, cold
and after a cached prefix read from the store; a short prompt never uses a group; a stage killed
mid-prefill moves the request elsewhere with the same output.
Shapes: prefill instances only: pipeline groups are made of them."""

from __future__ import annotations

import threading

import httpx
import pytest

from mooncake.testing.api import complete, metric, metrics
from mooncake.testing.cluster import running_cluster, small_config
from mooncake.testing.wait import wait_for

from oracle import greedy

pytestmark = pytest.mark.timeout(900)
TEXT = ("Stage one computes the first layers of a chunk and hands its hidden states on; meanwhile the "
        "next chunk enters stage one, and every stage ships its own layers of the cache to decode. ")
FAST = {"heartbeat_s": 0.5, "dead_after_s": 2.0, "cpp_min_tokens": 256}


@pytest.fixture(scope="module", params=[2, 3])
def cluster(request, tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("data"), cpp_group_size=request.param, **FAST)
    cfg.engine.prefill_chunk_tokens = 64
    with running_cluster(prefill=3, cfg=cfg) as c:
        c.group_size = request.param
        yield c


@pytest.fixture(scope="module")
def words(loaded_model) -> list[int]:
    return loaded_model.tokenizer(TEXT * 100)["input_ids"]


@pytest.fixture(scope="module")
def expected(oracle_model, loaded_model):
    def text(ids: list[int], n: int = 8) -> str:
        return loaded_model.tokenizer.decode(greedy(oracle_model, ids, n), skip_special_tokens=True)
    return text


def nodes(c, role: str) -> list[dict]:
    return [n for n in httpx.get(c.url + "/cluster", timeout=10).json()["nodes"] if n["role"] == role]


def served_by_groups(c) -> float:
    return metric(metrics(c.url), "mooncake:pipeline_requests_total")


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_stage_ingress_registered(cluster):
    assert all(n["endpoints"].get("act") for n in nodes(cluster, "prefill"))


def test_long_prompt_through_a_group_matches_transformers(cluster, words, expected):
    prompt = words[:600]  # 10 chunks
    before = served_by_groups(cluster)
    assert text_of(complete(cluster.url, prompt, max_tokens=8, ignore_eos=True)) == expected(prompt)
    text = metrics(cluster.url)
    assert metric(text, "mooncake:pipeline_requests_total") == before + 1
    for stage in range(cluster.group_size):
        assert metric(text, "mooncake:pipeline_stage_compute_seconds_total", stage=str(stage)) > 0
    # stages hand on one [tokens, hidden] float32 frame per chunk (576 wide): at least the prompt once
    assert metric(text, "mooncake:pipeline_activation_bytes_total") >= 600 * 576 * 4


def test_short_prompt_alone_then_its_prefix_reused_by_a_group(cluster, words, expected):
    short = words[700:900]  # 200 tokens < cpp_min_tokens: one instance, its blocks go to the store
    before = served_by_groups(cluster)
    assert text_of(complete(cluster.url, short, max_tokens=8, ignore_eos=True)) == expected(short)
    assert served_by_groups(cluster) == before
    wait_for(lambda: max(n["blocks_indexed"] for n in nodes(cluster, "store")) >= 12, 30, "the prefix in the store")
    longer = short[:192] + words[1000:1400]  # 400 tokens to compute after a 192-token prefix
    r = complete(cluster.url, longer, max_tokens=8, ignore_eos=True)
    assert text_of(r) == expected(longer)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert served_by_groups(cluster) == before + 1
    # the group's prompt blocks reach the store whole (written by decode once assembled)
    wait_for(lambda: max(n["blocks_indexed"] for n in nodes(cluster, "store")) >= 12 + 24, 30, "the group's blocks")


def test_stage_killed_mid_prefill_completes_elsewhere_with_the_same_output(cluster, words, expected):
    prompt = words[1400:2600]  # 19 chunks: long enough to kill a stage while it computes
    assert len(prompt) == 1200
    migrations = metric(metrics(cluster.url), "mooncake:migrations_total")
    result: list[httpx.Response] = []
    t = threading.Thread(target=lambda: result.append(complete(cluster.url, prompt, max_tokens=8, ignore_eos=True)))
    t.start()
    victim: list[dict] = []

    def stage_running() -> bool:
        busy = [n for n in nodes(cluster, "prefill") if n["queued"]]
        if len(busy) >= cluster.group_size:  # booked on every stage: the group has it, no first token yet
            victim.append(max(busy, key=lambda n: n["node_id"]))  # the last stage
            cluster.kill("prefill" + victim[0]["name"].removeprefix("node"))
            return True
        return False

    wait_for(stage_running, 60, "a group computing the prompt")
    t.join(300)
    assert text_of(result[0]) == expected(prompt)
    assert metric(metrics(cluster.url), "mooncake:migrations_total") >= migrations + 1
    assert victim[0]["node_id"] not in [n["node_id"] for n in nodes(cluster, "prefill")]
