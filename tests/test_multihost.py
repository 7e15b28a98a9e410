"""The cluster across hosts: network namespaces on a bridge (mooncake/testing/hosts.py), one
address each, 1 Gbit/s egress caps. host1: conductor (with its in-process frontend) + store;
host2: prefill + store; host3: decode; host4: decode + a frontend of its own (tokens stream to
it from both decode hosts). Per-host configs come from config.example.toml's values with
only [node] name/host and the conductor's address changed, and CURVE role keys (roles
off loopback refuse to start without them). Every output is checked against
transformers (float32 greedy); links are taken down and back up."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mooncake.blocks import hash_blocks
from mooncake.config import MiB, load_config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.security import Curve, generate_keys
from mooncake.testing.api import MODEL, complete, metric, metrics
from mooncake.testing.hosts import Hosts, leftovers, unavailable_reason
from mooncake.testing.wait import wait_for
from mooncake.tiers.client import StoreClient

from oracle import greedy

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]
DEAD_AFTER_S = 6.0
HEALTH_PORTS = {"store": 8081, "prefill": 8082, "decode": 8083}  # two roles share host1 and host2


class Cluster:
    def __init__(self, hosts: Hosts, operator: Curve) -> None:
        self.hosts = hosts
        self.operator = operator  # the conductor's key: the test acts on stores as the conductor would
        self.url = f"http://{hosts[1].address}:8000"

    def nodes(self, role: str) -> list[dict]:
        return [n for n in httpx.get(self.url + "/cluster", timeout=10).json()["nodes"] if n["role"] == role]

    def host_of(self, node: dict) -> int:
        return int(node["name"].removeprefix("host"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = load_config(ROOT / "config.example.toml", env={})  # port 8000, endpoint port 5550: own stacks
    base.engine.kv_cache_bytes, base.engine.threads = 160 * MiB, 1  # test-sized, as mooncake/testing/cluster.py
    base.model.dtype = "float32"  # compared with transformers token for token
    base.store.dram_bytes, base.store.lmdb_bytes = 128 * MiB, 256 * MiB
    base.liveness.heartbeat_s, base.liveness.dead_after_s = 0.5, DEAD_AFTER_S
    base.admission.request_timeout_s = 60.0
    resolve_model_dir(base.model)  # convert once, before the roles race for it
    work = tmp_path_factory.mktemp("hosts")
    generate_keys(work / "keys")
    base.security.curve_keys_dir = str(work / "keys")
    hosts = Hosts(4, work, rate="1gbit")
    try:
        layout = {1: ["conductor", "store"], 2: ["store", "prefill"], 3: ["decode"], 4: ["decode", "frontend"]}
        for i, roles in layout.items():
            cfg = hosts.config_for(base, i)
            if i != 1:  # a frontend of its own serves on its own host's address
                cfg.frontend.host = hosts[i].address
            cfg.store.data_dir = str(work / f"data{i}")
            if "prefill" in roles:  # a small device cache, so that a test can push a prefix out of it
                cfg.engine.kv_cache_bytes = 32 * MiB
            for role in roles:
                cfg.node.health_port = HEALTH_PORTS.get(role, 0)
                hosts.spawn(i, role, cfg)
        c = Cluster(hosts, Curve(work / "keys", "conductor"))

        hosts.wait_registered(c.url, {"prefill": 1, "decode": 2, "colocated": 0, "store": 2, "frontend": 2}, "the four hosts' roles to register")
        yield c
    finally:
        hosts.close()
        assert not leftovers(), leftovers()


def oracle(oracle_model, tokenizer, ids: list[int], n: int) -> str:
    gen = greedy(oracle_model, ids, n)
    assert tokenizer.eos_token_id not in gen, "pick a prompt whose continuation has no eos"
    return tokenizer.decode(gen, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_roles_run_on_their_own_hosts_and_match_transformers(cluster, oracle_model, tokenizer):
    hosts = cluster.hosts
    where = {(n["role"], n["name"]) for n in httpx.get(cluster.url + "/cluster", timeout=10).json()["nodes"]}
    assert where == {("store", "host1"), ("store", "host2"), ("prefill", "host2"), ("decode", "host3"),
                     ("decode", "host4"), ("frontend", "host1"), ("frontend", "host4")}
    for n in cluster.nodes("decode") + cluster.nodes("store"):
        endpoint = next(iter(n["endpoints"].values()))
        assert f"//{hosts[cluster.host_of(n)].address}:" in endpoint, n  # bound on its own address
    assert httpx.get(cluster.url + "/health/ready", timeout=5).status_code == 200
    assert httpx.get(cluster.url + "/health/live", timeout=5).status_code == 200
    for i, role in ((1, "store"), (2, "store"), (2, "prefill"), (3, "decode"), (4, "decode")):
        r = httpx.get(f"http://{hosts[i].address}:{HEALTH_PORTS[role]}/health/ready", timeout=5)
        assert r.status_code == 200 and r.json()["role"] == role, (i, r.text)  # across the bridge
    prompt = "The capital of France is"
    expected = oracle(oracle_model, tokenizer, tokenizer.encode(prompt), 24)
    assert text_of(complete(cluster.url, prompt, max_tokens=24, ignore_eos=True)) == expected


def test_a_frontend_on_its_own_host_gets_its_tokens_from_both_decode_hosts_under_curve(cluster, oracle_model,
                                                                                       tokenizer):
    url = f"http://{cluster.hosts[4].address}:8000"
    prompts = ["The capital of France is", "Water boils at", "The first president of the United States",
               "A haiku about autumn:"]
    expected = [oracle(oracle_model, tokenizer, tokenizer.encode(p), 16) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # enough at once for both decode hosts to take some
        got = list(pool.map(lambda p: complete(url, p, 16, ignore_eos=True), prompts))
    assert [text_of(r) for r in got] == expected
    view = httpx.get(url + "/cluster", timeout=10).json()
    assert view["leader"] == "host1" and view["frontend"].startswith("host4")
    tokens = next(n for n in view["nodes"] if n["node_id"] == view["frontend"])["endpoints"]["tokens"]
    assert f"//{cluster.hosts[4].address}:" in tokens  # decodes reach it across the bridge
    assert metric(metrics(url), "mooncake:frontend_tokens_refused_total") == 0


async def _move_to_remote_store(operator: Curve, hashes: list[bytes], local: str, remote: str) -> None:
    """Copy blocks store-to-store (host2 -> host1, the real replication path), then drop the local copy."""
    near, far = StoreClient(local, curve=operator), StoreClient(remote, curve=operator)
    try:
        for _ in range(100):  # the prefill writes its blocks in the background
            if all(await near.exists(hashes)):
                break
            await asyncio.sleep(0.1)
        assert await near.replicate(hashes, remote) == len(hashes)
        assert all(await far.exists(hashes))
        assert await near.remove(hashes) == len(hashes)
    finally:
        near.close()
        far.close()


async def _store_hits(operator: Curve, endpoint: str) -> int:
    client = StoreClient(endpoint, curve=operator)
    try:
        return sum(t.get("hits", 0) for t in (await client.stats())["tiers"])
    finally:
        client.close()


def test_shared_prefix_is_served_from_a_remote_store(cluster, oracle_model, tokenizer):
    shared = list(range(7000, 7064))  # 4 blocks of 16
    for _ in range(2):  # the store takes a prefix once it recurs ([conductor] store_writes = "reused")
        assert complete(cluster.url, shared + [11, 12, 13], max_tokens=2).status_code == 200
    model_id = httpx.get(cluster.url + "/v1/models", timeout=5).json()["data"][0]["model_id"]
    hashes = [bytes(h) for h in hash_blocks(shared, 16, model_id)]
    stores = {n["name"]: n for n in cluster.nodes("store")}
    near, far = stores["host2"]["endpoints"]["store"], stores["host1"]["endpoints"]["store"]
    asyncio.run(_move_to_remote_store(cluster.operator, hashes, near, far))
    for start in (20000, 21000):  # two 600-token prompts push the prefix out of the prefill's device cache
        assert complete(cluster.url, list(range(start, start + 600)), max_tokens=1).status_code == 200
    wait_for(lambda: next(n for n in cluster.nodes("store") if n["name"] == "host1")["blocks_indexed"] >= 4,
             15, "the conductor to index the remote store's copy")
    hits_before = asyncio.run(_store_hits(cluster.operator, far))
    moved_before = metric(metrics(cluster.url), "mooncake:kv_bytes_moved_total", path="store_to_prefill")
    prompt = shared + [21, 22, 23]
    r = complete(cluster.url, prompt, max_tokens=12, ignore_eos=True)
    assert text_of(r) == oracle(oracle_model, tokenizer, prompt, 12)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared)
    assert metric(metrics(cluster.url), "mooncake:kv_bytes_moved_total", path="store_to_prefill") > moved_before
    assert asyncio.run(_store_hits(cluster.operator, far)) >= hits_before + len(hashes)  # read from host1's store


LONG = {"model": MODEL, "prompt": "The history of the printing press", "temperature": 0, "ignore_eos": True}
LONG_TOKENS = 160


def test_decode_host_link_down_mid_stream_migrates_and_completes(cluster, oracle_model, tokenizer):
    expected = oracle(oracle_model, tokenizer, tokenizer.encode(LONG["prompt"]), LONG_TOKENS)
    migrations = metric(metrics(cluster.url), "mooncake:migrations_total")
    events: list = []
    lost = 0
    body = {**LONG, "max_tokens": LONG_TOKENS, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if len(events) == 4:  # tokens are flowing: cut the decode host serving this request
                busy = [n for n in cluster.nodes("decode") if n["assigned"]]
                assert len(busy) == 1, busy
                lost = cluster.host_of(busy[0])
                cluster.hosts.link(lost, up=False)
    assert events[-1] == "[DONE]", events[-3:]
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if isinstance(e, dict) and e.get("choices"))
    assert text == expected
    assert metric(metrics(cluster.url), "mooncake:migrations_total") == migrations + 1
    assert [cluster.host_of(n) for n in cluster.nodes("decode")] == [7 - lost]  # only the other one


def test_restored_decode_host_rejoins_and_serves(cluster, oracle_model, tokenizer):
    for i in (3, 4):  # the host cut by the previous test comes back
        cluster.hosts.link(i, up=True)
    wait_for(lambda: len(cluster.nodes("decode")) == 2, 30, "the restored decode host to register again")
    expected = oracle(oracle_model, tokenizer, tokenizer.encode(LONG["prompt"]), 48)
    served_by: set[int] = set()
    stop = threading.Event()

    def watch() -> None:  # which decode hosts hold a request while the two run
        while not stop.is_set():
            served_by.update(cluster.host_of(n) for n in cluster.nodes("decode") if n["assigned"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _: complete(cluster.url, LONG["prompt"], max_tokens=48, ignore_eos=True),
                                range(2)))
    finally:
        stop.set()
        watcher.join()
    assert [text_of(r) for r in got] == [expected, expected]
    assert served_by == {3, 4}  # the rejoined host took one of them


def test_conductor_host_link_down_briefly_loses_no_request(cluster, oracle_model, tokenizer):
    prompts = ["Once upon a time", "The sky is blue because", "def add(a, b):"]
    expected = [oracle(oracle_model, tokenizer, tokenizer.encode(p), 32) for p in prompts]
    migrations = metric(metrics(cluster.url), "mooncake:migrations_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, cluster.url, p, 32, ignore_eos=True) for p in prompts]
        wait_for(lambda: httpx.get(cluster.url + "/cluster", timeout=5).json()["requests"] > 0, 30,
                 "requests in flight")
        cluster.hosts.link(1, up=False)
        time.sleep(DEAD_AFTER_S / 3)  # an outage shorter than dead_after_s (the scenario itself)
        cluster.hosts.link(1, up=True)
        got = [f.result() for f in futures]
    assert [text_of(r) for r in got] == expected
    assert metric(metrics(cluster.url), "mooncake:migrations_total") == migrations  # nobody was declared dead
    assert httpx.get(cluster.url + "/health", timeout=5).json()["nodes"] == {"prefill": 1, "decode": 2, "colocated": 0, "store": 2,
                                                                            "frontend": 2}
