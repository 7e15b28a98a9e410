"""Layer-wise prefix loading in a real cluster (issue 12): a prompt whose prefix left the prefill's
device cache is read back from the store's DRAM tier layer by layer while the new tokens compute,
with layer-wise and block-wise KV transfer to decode; a store that sends a corrupt slice, or dies
mid-stream, costs a recompute and the output is transformers' greedy output all the same.
Shapes: the pair only: it checks layer-wise loading beside layer-wise transfer to decode (a
colocated instance's prefix read back from the store: test_kv_codec.py, test_shapes.py)."""

from __future__ import annotations

import httpx
import pytest

from mooncake.config import MiB
from mooncake.testing.api import complete, metric, metrics
from mooncake.testing.cluster import running_cluster, small_config
from mooncake.testing.wait import wait_for
from mooncake.tiers.store_requests import STREAM_FAULT_ENV

from oracle import greedy

pytestmark = pytest.mark.timeout(600)
TEXT = ("A cached prefix comes back from the store one layer at a time, each layer landing just "
        "before the layer of the forward that reads it. ")
OTHER = ("Whatever the store sends is checked against the checksum each block was written with; a "
         "block that fails it is a miss and is computed again, so a damaged copy never reaches the "
         "output, and a store that stops answering halfway costs time, never correctness. ") * 2


@pytest.fixture(scope="module")
def prompts(loaded_model) -> dict[str, list[int]]:
    ids = loaded_model.tokenizer(TEXT * 8)["input_ids"]
    other = loaded_model.tokenizer(OTHER)["input_ids"]
    first = ids[:203]
    return {"first": first, "again": first[:160] + other[:90],  # 10 cached blocks, 90 new tokens (2 chunks)
            "flush": [[(k * 7919 + i * 13) % 40000 + 1000 for i in range(200)] for k in range(3)]}


def cfg_for(tmp_path, kv_transfer: str = "layer"):
    cfg = small_config(tmp_path, heartbeat_s=0.5, dead_after_s=2.0)
    cfg.engine.kv_load = "layer"
    cfg.engine.kv_transfer = kv_transfer  # type: ignore[assignment]
    cfg.engine.kv_cache_bytes = 24 * MiB  # ~33 blocks: three 200-token prompts push the first one out
    cfg.engine.prefill_chunk_tokens = 64
    return cfg


def store_hits(url: str) -> float:
    nodes = httpx.get(url + "/cluster", timeout=10).json()["nodes"]
    return sum(n["load"].get("tiers", {}).get("dram", {}).get("hits", 0) for n in nodes if n["role"] == "store")


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def run_again_from_the_store(c, prompts, expected) -> httpx.Response:
    """Compute the first prompt (its blocks go to the store), flush it from the prefill's device
    cache, then send the prompt that shares its 160-token prefix."""
    assert text(complete(c.url, prompts["first"], max_tokens=4, ignore_eos=True)) == expected(prompts["first"], 4)
    for other in prompts["flush"]:
        assert complete(c.url, other, max_tokens=2, ignore_eos=True).status_code == 200
    r = complete(c.url, prompts["again"], max_tokens=10, ignore_eos=True)
    assert text(r) == expected(prompts["again"], 10)
    return r


@pytest.fixture(scope="module")
def expected(oracle_model, loaded_model):
    def fn(ids: list[int], n: int) -> str:
        return loaded_model.tokenizer.decode(greedy(oracle_model, ids, n), skip_special_tokens=True)
    return fn


@pytest.mark.parametrize("kv_transfer", ["layer", "block"])
def test_a_prefix_streamed_from_the_store_gives_transformers_output(tmp_path, prompts, expected, kv_transfer):
    with running_cluster(cfg=cfg_for(tmp_path, kv_transfer)) as c:
        r = run_again_from_the_store(c, prompts, expected)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 160  # all of it from the store
        wait_for(lambda: store_hits(c.url) >= 10, 30, "the store's DRAM hits in its heartbeat")
        assert metric(metrics(c.url), "mooncake:kv_blocks_rejected_total") == 0


@pytest.mark.parametrize("fault", ["corrupt", "die:4"])
def test_a_corrupt_or_dying_stream_costs_a_recompute_not_the_output(tmp_path, monkeypatch, prompts, expected, fault):
    monkeypatch.setenv(STREAM_FAULT_ENV, fault)  # read by the store process only
    with running_cluster(cfg=cfg_for(tmp_path)) as c:
        monkeypatch.delenv(STREAM_FAULT_ENV)
        r = run_again_from_the_store(c, prompts, expected)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
        reason = "checksum" if fault == "corrupt" else "stream"
        wait_for(lambda: metric(metrics(c.url), "mooncake:kv_blocks_rejected_total", reason=reason) == 10, 30,
                 f"the prefill's {reason} rejection in its heartbeat")
