"""A leader partitioned from etcd but not from the workers (issue 52's first Done-when): network
namespaces on a bridge (``mooncake/testing/hosts.py``): host1 runs etcd, host2 and host3 a
conductor each, host4 a frontend, a store and a prefill, host5 a decode, under CURVE. While
greedy completions trickle in through the frontend, the leading conductor's host loses etcd
alone: a static neighbour entry in its namespace sends etcd's address to a MAC address nobody
has, so what it sends etcd is dropped silently (no error comes back, as in a real partition),
while the frontend, the workers and the store still reach it and it them. (Neither iptables nor
nft is installed here, and tc's drop action needs a kernel module this kernel lacks: the
neighbour entry needs neither.)

Within ``lease_ttl_s`` the old leader stops acting (its readiness goes, and it books nothing
after); the other conductor leads under a higher term; an order of the old term sent to the
store once the new leader spoke is refused (``stale_term``, counted in
``mooncake:stale_term_refused``), one of the new term is taken; no attempt is booked under two
terms, and the old term's last booking comes before the new term's first (each conductor logs
every ``Admitted`` it sends, with its term, at debug level: ``conductor/router.py``); every
request completes with transformers' greedy output.

Shapes: the pair: leadership, its terms and its fencing are the conductor's and the same in every
shape (the workers only follow the leader and keep the newest term); a colocated cluster adds nothing.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from mooncake.config import MiB, load_config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.security import Curve, generate_keys
from mooncake.testing.api import complete
from mooncake.testing.etcd import EtcdServer
from mooncake.testing.hosts import Hosts, leftovers, unavailable_reason
from mooncake.testing.wait import wait_for
from mooncake.tiers.client import StoreClient, StoreError

from oracle import greedy

ROOT = Path(__file__).resolve().parent.parent
UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]
LEASE_TTL_S = 3
RATE = 2.0  # completions a second, all along the test
TOKENS = 12
CONDUCTOR_HEALTH = 8083
NOWHERE_MAC = "02:00:5e:00:00:01"  # a locally administered address no host on the bridge has
ADMITTED = re.compile(r"admitted (\S+) under term (\d+) at ([\d.]+)")
ROLES = {2: ["conductor"], 3: ["conductor"], 4: ["frontend", "store", "prefill"], 5: ["decode"]}


def etcd_in(hosts: Hosts, i: int, work: Path) -> EtcdServer:
    """A real etcd inside host ``i`` (its binary run through ``ip netns exec``), started."""
    etcd = EtcdServer(work / "etcd", host=hosts[i].address)
    wrapper = work / "etcd-in-host"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {hosts[i].ns} {etcd.binary} "$@"\n')
    wrapper.chmod(0o755)
    etcd.binary = str(wrapper)  # ip netns exec execs into etcd: the process is etcd itself
    etcd.start()
    return etcd


def cut_from(hosts: Hosts, i: int, address: str) -> None:
    """Host ``i`` sends nothing more to ``address`` (dropped silently: see the module's docstring)."""
    subprocess.run(["ip", "netns", "exec", hosts[i].ns, "ip", "neigh", "replace", address, "lladdr", NOWHERE_MAC,
                    "dev", "eth0", "nud", "permanent"], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    base = load_config(ROOT / "config.example.toml", env={})
    base.engine.kv_cache_bytes, base.engine.threads = 160 * MiB, 1
    base.model.dtype = "float32"  # compared with transformers token for token
    base.store.dram_bytes, base.store.lmdb_bytes = 128 * MiB, 256 * MiB
    base.liveness.heartbeat_s, base.liveness.dead_after_s = 0.5, 4.0
    resolve_model_dir(base.model)
    work = tmp_path_factory.mktemp("partition")
    generate_keys(work / "keys")
    base.security.curve_keys_dir = str(work / "keys")
    h = Hosts(5, work)
    etcd = None
    try:
        etcd = etcd_in(h, 1, work)
        base.coordination.etcd_endpoints = [etcd.url]
        base.coordination.lease_ttl_s, base.coordination.poll_s = LEASE_TTL_S, 0.25
        base.coordination.prefix = "/mooncake/partition"
        for i, roles in ROLES.items():
            cfg = h.config_for(base, i, conductor_host=i if i <= 3 else 2)
            cfg.frontend.host = h[i].address
            cfg.store.data_dir = str(work / f"data{i}")
            for role in roles:  # roles sharing host4 each answer probes on their own port
                cfg.node.health_port = {"store": 8081, "prefill": 8082}.get(role, CONDUCTOR_HEALTH)
                h.spawn(i, role, cfg, log_level="debug" if role == "conductor" else "warning")
        h.url = f"http://{h[4].address}:8000"

        h.wait_registered(h.url, {"prefill": 1, "decode": 1, "colocated": 0, "store": 1, "frontend": 1}, "the hosts' roles to register")
        yield h
    finally:
        h.close()
        if etcd is not None:
            etcd.stop()
        assert not leftovers(), leftovers()


def snapshot(hosts: Hosts, timeout_s: float = 3.0) -> dict | None:
    """``GET /cluster`` through the frontend (None: no answer now)."""
    try:
        r = httpx.get(hosts.url + "/cluster", timeout=timeout_s)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def acting(hosts: Hosts, i: int) -> bool:
    """Whether host ``i``'s conductor says it is ready (it leads and acts); gone: not."""
    try:
        return httpx.get(f"http://{hosts[i].address}:{CONDUCTOR_HEALTH}/health/ready", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def bookings(hosts: Hosts) -> list[tuple[str, int, float]]:
    """(wire id, term, wall time) of every ``Admitted`` either conductor sent (their debug logs)."""
    out = []
    for i in (2, 3):
        text = (hosts.workdir / f"host{i}-conductor.log").read_text(errors="replace")
        out += [(m[1], int(m[2]), float(m[3])) for m in ADMITTED.finditer(text)]
    return out


async def store_orders(endpoint: str, keys_dir: str, old_term: int, new_term: int) -> tuple[str, int]:
    """A store order (Remove of a block nobody has) under the old term, as the old leader's
    replicator would send it, then one under the new term: (the first's error code, the second's answer)."""
    client = StoreClient(endpoint, curve=Curve.from_dir(keys_dir, "conductor"), shm=False, timeout_s=10)
    try:
        client.term = old_term
        try:
            await client.remove([b"\x7f" * 32])
            code = "accepted"
        except StoreError as e:
            code = e.code
        client.term = new_term
        return code, await client.remove([b"\x7f" * 32])
    finally:
        client.close()


def refused_at(hosts: Hosts, i: int, message: str) -> float:
    """``mooncake:stale_term_refused`` of ``message`` summed over nodes, on host ``i``'s conductor."""
    text = httpx.get(f"http://{hosts[i].address}:{CONDUCTOR_HEALTH}/metrics", timeout=3).text
    pat = re.compile(r'^mooncake:stale_term_refused_total\{[^}]*message="' + message + r'"[^}]*\} ([\d.e+]+)$', re.M)
    return sum(float(v) for v in pat.findall(text))


def test_a_leader_cut_off_from_etcd_alone_stops_acting_and_its_term_is_fenced(cluster: Hosts, oracle_model,
                                                                              loaded_model) -> None:
    hosts, tok = cluster, loaded_model.tokenizer
    prompts = ["Once upon a time", "The sky is blue because", "def add(a, b):", "Water boils at"]
    expected = {p: tok.decode(greedy(oracle_model, tok.encode(p), TOKENS), skip_special_tokens=True) for p in prompts}
    snap = snapshot(hosts, 10)
    assert snap is not None and snap["leader"] in ("host2", "host3"), snap
    old, old_term = int(snap["leader"].removeprefix("host")), snap["leader_term"]
    new = 5 - old
    assert old_term > 0 and acting(hosts, old) and not acting(hosts, new)

    sent: list[tuple[str, Future]] = []
    stop = threading.Event()
    with ThreadPoolExecutor(32) as pool:
        def trickle() -> None:
            while not stop.is_set():
                p = prompts[len(sent) % len(prompts)]
                sent.append((p, pool.submit(complete, hosts.url, p, TOKENS, ignore_eos=True)))
                stop.wait(1 / RATE)

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        try:
            time.sleep(3)  # requests in flight under the old leader
            cut_from(hosts, old, hosts[1].address)  # etcd's host
            cut_at, cut_wall = time.monotonic(), time.time()
            while acting(hosts, old) and time.monotonic() - cut_at < LEASE_TTL_S + 10:
                time.sleep(0.05)
            stopped_s = time.monotonic() - cut_at
            wait_for(lambda: (s := snapshot(hosts)) is not None and s["leader"] == f"host{new}"
                     and s["nodes"] and any(n["role"] == "store" for n in s["nodes"]), 30,
                     f"host{new}'s conductor to lead, the store registered with it")
            led_s = time.monotonic() - cut_at
            snap = snapshot(hosts, 10)
            assert snap is not None and snap["leader"] == f"host{new}", snap
            new_term = snap["leader_term"]
            store = next(n for n in snap["nodes"] if n["role"] == "store")["endpoints"]["store"]
            code, removed = asyncio.run(store_orders(store, str(hosts.workdir / "keys"), old_term, new_term))
            time.sleep(5)  # the trickle goes on under the new leader
        finally:
            stop.set()
            feeder.join()
        results = [(p, f.result()) for p, f in sent]

    # the old leader stopped acting within the lease's TTL; the other leads, under a higher term
    assert stopped_s <= LEASE_TTL_S, f"host{old}'s conductor acted {stopped_s:.1f}s after it lost etcd"
    assert new_term > old_term, (old_term, new_term)
    assert led_s <= LEASE_TTL_S + 5, f"host{new}'s conductor led {led_s:.1f}s after host{old}'s lost etcd"
    # an order of the old term, sent after the new leader spoke, is refused (and counted); the new term's is taken
    assert code == "stale_term" and removed == 0, (code, removed)
    wait_for(lambda: refused_at(hosts, new, "Remove") >= 1, 10, "the store's refusal to reach the metrics")
    # nobody booked an attempt twice, and the two leaders' bookings never overlapped in time
    booked = bookings(hosts)
    terms: dict[str, set[int]] = {}
    for wire_id, term, _ in booked:
        terms.setdefault(wire_id, set()).add(term)
    assert {t for _, t, _ in booked} == {old_term, new_term}, booked  # both leaders booked some
    assert [w for w, ts in terms.items() if len(ts) > 1] == [], "attempts booked under two terms"
    last_old = max(at for _, t, at in booked if t == old_term)
    first_new = min(at for _, t, at in booked if t == new_term)
    assert last_old < first_new and last_old <= cut_wall + LEASE_TTL_S, (last_old - cut_wall, first_new - cut_wall)
    # every request completed, with transformers' greedy output
    assert len(results) >= RATE * (3 + 5), len(results)
    for p, r in results:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[p], p
