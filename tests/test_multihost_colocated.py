"""A colocated instance on a host of its own: network namespaces on a bridge
(mooncake/testing/hosts.py), 1 Gbit/s egress caps, CURVE role keys. host1: conductor (with its
in-process frontend) + store; host2: colocated. Its prompts' blocks go to host1's store across
the link, a later prompt on the same document reuses them, and every output equals
transformers (float32 greedy)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mooncake.config import MiB, load_config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.security import generate_keys
from mooncake.testing.api import complete
from mooncake.testing.hosts import Hosts, leftovers, unavailable_reason
from mooncake.testing.wait import wait_for

from oracle import greedy

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    base = load_config(ROOT / "config.example.toml", env={})
    base.engine.kv_cache_bytes, base.engine.threads = 160 * MiB, 1
    base.model.dtype = "float32"
    base.store.dram_bytes, base.store.lmdb_bytes = 128 * MiB, 256 * MiB
    base.conductor.store_writes = "all"  # the first prompt's blocks go to the store at once
    resolve_model_dir(base.model)
    work = tmp_path_factory.mktemp("hosts")
    generate_keys(work / "keys")
    base.security.curve_keys_dir = str(work / "keys")
    hosts = Hosts(2, work, rate="1gbit")
    try:
        for i, roles in {1: ["conductor", "store"], 2: ["colocated"]}.items():
            cfg = hosts.config_for(base, i)
            cfg.store.data_dir = str(work / f"data{i}")
            for role in roles:
                cfg.node.health_port = 8081 if role == "store" else 0
                hosts.spawn(i, role, cfg)
        url = f"http://{hosts[1].address}:8000"

        def ready() -> bool:
            assert all(p.poll() is None for h in hosts.hosts for p in h.procs.values()), hosts.logs()
            try:
                nodes = httpx.get(url + "/health", timeout=2).json()["nodes"]
                return {role: n for role, n in nodes.items() if n} == {"colocated": 1, "store": 1, "frontend": 1}
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        wait_for(ready, 240, "the two hosts' roles to register")
        yield url
    finally:
        hosts.close()
        assert not leftovers(), leftovers()


def test_a_colocated_host_serves_exactly_and_writes_its_blocks_across_the_link(url, loaded_model, oracle_model):
    tok = loaded_model.tokenizer
    nodes = httpx.get(url + "/cluster", timeout=10).json()["nodes"]
    assert {(n["role"], n["name"]) for n in nodes} >= {("colocated", "host2"), ("store", "host1")}
    doc = tok("Colocated instances prefill and decode in one engine on their own host. " * 6)["input_ids"]
    for i in range(2):
        ids = doc + tok(f" Part {i}:")["input_ids"]
        r = complete(url, ids, max_tokens=16, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(greedy(oracle_model, ids, 16), skip_special_tokens=True)

    def stored() -> int:
        store = next(n for n in httpx.get(url + "/cluster", timeout=10).json()["nodes"] if n["role"] == "store")
        return sum(t["blocks"] for t in store["load"]["tiers"].values())

    wait_for(lambda: stored() >= len(doc) // 16, 30, "host2's blocks in host1's store")
