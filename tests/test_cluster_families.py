"""``mooncake serve`` serving each new family's tiny model in each shape: the colocated default and
the whole disaggregated path (conductor -> prefill -> KV to decode, blocks to the store), greedy
output equal to transformers in float32. One small cluster per family and shape, started in
turn; the Qwen3 one is found by repo id in a local Hugging Face cache, with a served name and a
context limit of its own."""

from __future__ import annotations

import httpx
import pytest
import torch

from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.cluster import SHAPES, running_cluster, small_config

from hf_cache import hf_cache_with

SERVED = ["qwen3", "gemma2", "gemma3", "phi3"]
TEXT = ("A block of keys and values is shared by every request whose prompt starts with the same "
        "tokens; a sliding window only ever looks back a few of them. ")


@pytest.fixture(scope="module", params=[(f, s) for s in SHAPES for f in SERVED], ids="-".join)
def served(request, tiny_models, tmp_path_factory):
    family, shape = request.param
    tmp = tmp_path_factory.mktemp(f"cluster-{family}-{shape}")
    cfg = small_config(tmp / "data")
    with pytest.MonkeyPatch.context() as mp:
        if family == "qwen3":
            mp.setenv("HF_HUB_CACHE", str(tmp / "hub"))  # the role processes inherit it
            hf_cache_with(tiny_models[family], tmp / "hub", "tiny-org/tiny-qwen3")
            cfg.model.path = "tiny-org/tiny-qwen3"
            cfg.engine.max_model_len = 384
        else:
            cfg.model.path = str(tiny_models[family])
            cfg.model.name = f"tiny-{family}"
        with running_cluster(cfg=cfg, **SHAPES[shape]) as cluster:
            yield family, cluster


def complete(cluster: LocalCluster, model: str, ids: list[int], n: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_output_equals_transformers(served, tiny_models, loaded_model):
    from transformers import AutoModelForCausalLM

    family, cluster = served
    tok = loaded_model.tokenizer
    models = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    name = models[0]["id"]
    if family == "qwen3":
        assert (name, models[0]["max_model_len"]) == ("tiny-org/tiny-qwen3", 384)
    else:
        assert (name, models[0]["max_model_len"]) == (f"tiny-{family}", 512)
    ref = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32,
                                               attn_implementation="eager").eval()
    base = tok(TEXT * 3)["input_ids"]
    for ids in (base[:70], base[:50] + tok(" and then something else entirely")["input_ids"]):
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=2)
        got = complete(cluster, name, ids, 20)
        assert got["choices"][0]["text"] == tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
        assert got["usage"]["completion_tokens"] == 20
    # the second prompt reused the first one's leading blocks
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
