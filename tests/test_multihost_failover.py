"""Conductors that fail over across hosts (issue 29): network namespaces on a bridge
(``mooncake/testing/hosts.py``) with etcd on the bridge's own address, as a separate machine.
host1 and host2: a conductor each, campaigning through etcd; host3: a frontend, a store and a
prefill; host4: a decode. All under CURVE (roles off loopback refuse to start without keys).
The leading conductor's host is cut off the network: its lease lapses, the conductor on the
other host leads, the frontend and the workers follow it across the bridge, and requests in
flight and after complete with transformers' output; the old leader, back on the network,
has stepped down."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mooncake.config import MiB, load_config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.security import generate_keys
from mooncake.testing.api import complete
from mooncake.testing.etcd import EtcdServer
from mooncake.testing.hosts import Hosts, leftovers, unavailable_reason
from mooncake.testing.wait import wait_for

from oracle import greedy

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.timeout(400), pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]
LEASE_TTL_S = 3


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    base = load_config(ROOT / "config.example.toml", env={})
    base.engine.kv_cache_bytes, base.engine.threads = 160 * MiB, 1
    base.model.dtype = "float32"  # compared with transformers token for token
    base.store.dram_bytes, base.store.lmdb_bytes = 128 * MiB, 256 * MiB
    base.liveness.heartbeat_s, base.liveness.dead_after_s = 0.5, 4.0
    resolve_model_dir(base.model)
    work = tmp_path_factory.mktemp("failover-hosts")
    generate_keys(work / "keys")
    base.security.curve_keys_dir = str(work / "keys")
    h = Hosts(4, work, rate="1gbit")
    etcd = None
    try:
        etcd = EtcdServer(work / "etcd", host=h.gateway)  # reached from every host across the bridge
        etcd.start()
        base.coordination.etcd_endpoints = [etcd.url]
        base.coordination.lease_ttl_s, base.coordination.poll_s = LEASE_TTL_S, 0.25
        base.coordination.prefix = "/mooncake/multihost-failover"
        for i, roles in {1: ["conductor"], 2: ["conductor"], 3: ["frontend", "store", "prefill"], 4: ["decode"]}.items():
            cfg = h.config_for(base, i, conductor_host=i if i <= 2 else 1)
            cfg.frontend.host = h[i].address
            cfg.store.data_dir = str(work / f"data{i}")
            for role in roles:  # roles sharing host3 each answer probes on their own port
                cfg.node.health_port = {"store": 8081, "prefill": 8082}.get(role, 8083)
                h.spawn(i, role, cfg)
        h.url = f"http://{h[3].address}:8000"

        h.wait_registered(h.url, {"prefill": 1, "decode": 1, "colocated": 0, "store": 1, "frontend": 1}, "the four hosts' roles to register")
        yield h
    finally:
        h.close()
        if etcd is not None:
            etcd.stop()
        assert not leftovers(), leftovers()


def test_the_leader_cut_off_hands_over_to_the_conductor_on_the_other_host(hosts, oracle_model, loaded_model):
    tok = loaded_model.tokenizer
    prompts = ["Once upon a time", "The sky is blue because", "def add(a, b):"]
    expected = [tok.decode(greedy(oracle_model, tok.encode(p), 24), skip_special_tokens=True) for p in prompts]
    leader = httpx.get(hosts.url + "/cluster", timeout=10).json()["leader"]
    assert leader in ("host1", "host2")
    old, new = int(leader.removeprefix("host")), 3 - int(leader.removeprefix("host"))
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, hosts.url, p, 24, ignore_eos=True) for p in prompts]
        time.sleep(0.5)
        hosts.link(old, up=False)
        cut_at = time.monotonic()

        def led_by_new() -> bool:
            try:
                return httpx.get(hosts.url + "/cluster", timeout=3).json()["leader"] == f"host{new}"
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        wait_for(led_by_new, LEASE_TTL_S + 30, f"host{new}'s conductor to lead")
        took = time.monotonic() - cut_at
        got = [f.result() for f in futures]
    assert took <= LEASE_TTL_S + 5, f"the conductor on host{new} led {took:.1f}s after host{old} was cut off"
    for r, want in zip(got, expected):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    hosts.link(old, up=True)
    wait_for(lambda: hosts[old].procs["conductor"].poll() is not None, 30,
             f"host{old}'s conductor to step down")  # it lost its lease while cut off
    assert hosts[old].procs["conductor"].returncode == 1
    r = complete(hosts.url, prompts[0], 24, ignore_eos=True)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[0]
    assert httpx.get(hosts.url + "/cluster", timeout=10).json()["leader"] == f"host{new}"
