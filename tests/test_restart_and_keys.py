"""A dev cluster with several API keys and ``salt_per_api_key``, stopped gracefully and started
again on the same data dir: /cluster and /metrics need a key (any configured one), probes do
not; tenants (keys) never share cached blocks, one tenant does; after the restart the same
prompt is served from the persisted cache with the same output. Two cluster starts per shape."""

from __future__ import annotations

import httpx
import pytest

from mooncake.frontend.tenant_clock import tenant_id
from mooncake.testing.api import MODEL, metric
from mooncake.testing.cluster import SHAPES, running_cluster, small_config
from mooncake.testing.wait import wait_for

pytestmark = pytest.mark.timeout(600)

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
PREFIX = list(range(1000, 1160))  # 10 full blocks of 16 tokens
PROMPT = PREFIX + [7, 8, 9, 10, 11]


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ask(url: str, key: str) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=bearer(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def store_blocks(url: str) -> int:
    nodes = httpx.get(url + "/cluster", headers=bearer(KEY_B), timeout=10).json()["nodes"]
    return sum(n["blocks_indexed"] for n in nodes if n["role"] == "store")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_keys_salts_and_a_graceful_restart_keeps_the_cache(tmp_path, shape):
    cfg = small_config(tmp_path / "data", api_key=KEY_A, api_keys=[KEY_B], drain_timeout_s=20.0)  # salts: the default
    cfg.classes.api_key_classes = [f"{KEY_B}=flex"]  # B's requests are flex; A's, without an entry, default at most
    with running_cluster(cfg=cfg, **SHAPES[shape]) as c:
        for path in ("/cluster", "/metrics"):
            assert httpx.get(c.url + path, timeout=10).status_code == 401
            assert httpx.get(c.url + path, headers=bearer("sk-wrong"), timeout=10).status_code == 401
            for key in (KEY_A, KEY_B):
                assert httpx.get(c.url + path, headers=bearer(key), timeout=10).status_code == 200
        for probe in ("/health", "/health/live", "/health/ready"):
            assert httpx.get(c.url + probe, timeout=10).status_code == 200
        first = ask(c.url, KEY_A)
        assert cached(first) == 0
        assert cached(ask(c.url, KEY_B)) == 0  # another tenant: not A's blocks
        assert cached(ask(c.url, KEY_A)) >= len(PREFIX)  # the same tenant shares
        b_again = ask(c.url, KEY_B)
        assert cached(b_again) >= len(PREFIX)
        assert first["service_tier"] == "default" and b_again["service_tier"] == "flex"
        for key, ceiling in ((KEY_B, "flex"), (KEY_A, "default")):  # a key's class is the most it gets
            named = httpx.post(c.url + "/v1/completions", headers=bearer(key), timeout=120, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2, "service_tier": "priority", "priority": -2**31})
            assert named.status_code == 200 and named.json()["service_tier"] == ceiling, named.text
        wait_for(lambda: store_blocks(c.url) >= 20, 60, "both tenants' blocks in the store")
        text = httpx.get(c.url + "/metrics", headers=bearer(KEY_B), timeout=10).text
        assert metric(text, "mooncake:prefix_cache_hits_total") >= 2 * len(PREFIX)
        for key, served in ((KEY_A, 3), (KEY_B, 3)):  # by tenant: the key's id, never the key
            assert metric(text, "mooncake:tenant_requests_total", tenant=tenant_id(key), outcome="ok") == served
            assert metric(text, "mooncake:tenant_tokens_total", tenant=tenant_id(key), kind="prompt") >= 2 * len(PROMPT)
        assert KEY_A not in text and KEY_B not in text
    cfg.frontend.port = small_config(tmp_path).frontend.port  # SIGTERMed above: start again on the same dir
    with running_cluster(cfg=cfg, **SHAPES[shape]) as c:
        wait_for(lambda: store_blocks(c.url) >= 20, 60, "the persisted blocks announced")
        again = ask(c.url, KEY_A)
        assert cached(again) >= 0.9 * len(PREFIX)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
