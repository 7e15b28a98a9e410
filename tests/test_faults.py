"""Fault tolerance on real dev clusters: kill -9 a store, a decode, a prefill instance while
requests run; restart a store on its LMDB directory. Decisions and outputs are asserted
(greedy output with a fault == the same request without it), never speed.
Shapes: the pair only: it kills each of the pair's roles by name (a colocated instance killed
mid-stream: test_colocated.py; failover in each shape: test_failover.py)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mooncake.config import MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL, complete, metric, metrics, stream, stream_text
from mooncake.testing.cluster import small_config, start_cluster
from mooncake.testing.wait import wait_for

pytestmark = pytest.mark.timeout(240)

FAST = {"heartbeat_s": 0.5, "dead_after_s": 2.0, "request_timeout_s": 60.0}


def _start(data_dir, prefill: int, decode: int, store: int, dram_bytes: int | None = None,
           **conductor: object) -> LocalCluster:
    cfg = small_config(data_dir, **{**FAST, **conductor})
    if dram_bytes is not None:
        cfg.store.dram_bytes = dram_bytes
    return start_cluster(prefill=prefill, decode=decode, store=store, cfg=cfg)


def nodes(c: LocalCluster, role: str) -> list[dict]:
    return [n for n in httpx.get(c.url + "/cluster", timeout=10).json()["nodes"] if n["role"] == role]


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream_killing(c: LocalCluster, body: dict, kill_after: int, victim) -> tuple[str, list]:
    """Stream ``body``; after ``kill_after`` events SIGKILL the child ``victim()`` names."""
    events = stream(c.url, body, lambda n, _: c.kill(victim()) if n == kill_after else None, timeout=90)
    assert events and events[-1] == "[DONE]", events[-3:]
    return stream_text(events), events


def decode_child(c: LocalCluster) -> str:
    """The child process name of the decode instance running the only request in flight."""
    busy = [n for n in nodes(c, "decode") if n["assigned"]]
    assert len(busy) == 1, busy
    return "decode" + busy[0]["name"].removeprefix("node")


# ---------------------------------------------------------------- 2 prefill, 2 decode, 2 stores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = _start(tmp_path_factory.mktemp("faults"), prefill=2, decode=2, store=2, hot_block_hits=2, replicas=2)
    yield c
    c.stop()


def test_store_killed_during_a_burst_loses_no_request_and_changes_no_output(cluster):
    prefixes = [list(range(1000 + 100 * i, 1000 + 100 * i + 64)) for i in range(4)]  # 4 blocks each
    prompts = [p + [50 + j, 60 + j] for p in prefixes for j in range(6)]  # 24 requests
    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda p: text_of(complete(cluster.url, p, max_tokens=6)), prompts))
    assert len(nodes(cluster, "store")) == 2

    def run(i_p):
        i, p = i_p
        if i == 6:
            cluster.kill("store0")
        return complete(cluster.url, p, max_tokens=6)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(run, enumerate(prompts)))
    assert [r.status_code for r in got] == [200] * len(prompts), [r.text for r in got if r.status_code != 200]
    assert [text_of(r) for r in got] == expected
    wait_for(lambda: len(nodes(cluster, "store")) == 1, 15, "the dead store to leave the cluster")
    assert text_of(complete(cluster.url, prompts[0], max_tokens=6)) == expected[0]


def test_decode_killed_mid_stream_migrates_without_losing_tokens(cluster):
    body = {"model": MODEL, "prompt": "The history of the printing press", "max_tokens": 60,
            "temperature": 0, "ignore_eos": True}
    expected = text_of(httpx.post(cluster.url + "/v1/completions", json=body, timeout=90))
    before = metric(metrics(cluster.url), "mooncake:migrations_total")
    text, events = stream_killing(cluster, body, 4, lambda: decode_child(cluster))
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    assert text == expected
    assert metric(metrics(cluster.url), "mooncake:migrations_total") == before + 1
    assert len(nodes(cluster, "decode")) == 1


def test_prefill_killed_with_queued_requests_they_complete_elsewhere(cluster):
    prompts = [list(range(3000 + 1000 * i, 3000 + 1000 * i + 700)) for i in range(6)]
    before = metric(metrics(cluster.url), "mooncake:migrations_total")
    killed: list[str] = []

    def kill_busiest() -> bool:
        busy = max(nodes(cluster, "prefill"), key=lambda n: n["queued"])
        if busy["queued"] >= 2:
            cluster.kill("prefill" + busy["name"].removeprefix("node"))
            killed.append(busy["node_id"])
            return True
        return False

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(complete, cluster.url, p, 4) for p in prompts]
        wait_for(kill_busiest, 60, "a prefill instance with 2 queued requests")
        got = [f.result() for f in futures]
    assert [r.status_code for r in got] == [200] * len(prompts), [r.text for r in got]
    assert metric(metrics(cluster.url), "mooncake:migrations_total") >= before + 2
    left = nodes(cluster, "prefill")
    assert [n["node_id"] for n in left] != killed and len(left) == 1
    # Fault-free pass on the survivor: the same greedy outputs.
    assert [text_of(r) for r in got] == [text_of(complete(cluster.url, p, 4)) for p in prompts]


# ---------------------------------------------------------------- 1 prefill, 1 decode, 1 store


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    # A DRAM tier of 4 MiB (a handful of blocks): a 20-block prefix is demoted to LMDB.
    c = _start(tmp_path_factory.mktemp("single"), prefill=1, decode=1, store=1, dram_bytes=4 * MiB)
    yield c
    c.stop()


def _lmdb(c: LocalCluster) -> dict:
    stores = nodes(c, "store")
    return stores[0]["load"].get("tiers", {}).get("lmdb", {}) if stores else {}


def test_restarted_store_serves_its_lmdb_blocks_again(single):
    prefix = list(range(9000, 9320))  # 20 blocks
    first = complete(single.url, prefix + [7, 8, 9], max_tokens=4)
    expected_next = text_of(complete(single.url, prefix + [11, 12], max_tokens=4))
    assert first.status_code == 200
    wait_for(lambda: _lmdb(single).get("used_bytes", 0) > 0, 20, "blocks demoted to LMDB")
    single.kill("store0")
    single.kill("prefill0")  # its device cache would hit too: the store must serve the prefix
    wait_for(lambda: not nodes(single, "store") and not nodes(single, "prefill"), 15, "both declared dead")
    single.spawn("store", 0)
    single.spawn("prefill", 0)
    wait_for(lambda: (lambda s: s and s[0]["blocks_indexed"] >= 15 and s[0]["load"])(nodes(single, "store"))
             and nodes(single, "prefill"), 120, "the store back with its blocks and a prefill instance")
    hits_before = _lmdb(single).get("hits", 0)
    r = complete(single.url, prefix + [11, 12], max_tokens=4)
    assert text_of(r) == expected_next
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 15 * 16
    wait_for(lambda: _lmdb(single).get("hits", 0) > hits_before, 10, "LMDB hits on the restarted store")


def test_a_decode_frozen_past_dead_after_s_frees_its_pool_once_back(single):
    """Declared dead while it held a long request, the decode's reservation is an orphan the
    conductor no longer knows: on its return it frees the blocks at once — the frontend's abort
    (sent when the conductor said the attempt ended) waits on its orders socket, and were that
    lost, its re-registration says what it holds and it is told to keep nothing (reconciliation,
    ``test_link_reconcile.py``). Without either it decoded on for minutes."""
    body = {"model": MODEL, "prompt": list(range(3000, 3600)), "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    decode = single.children["decode0"].pid

    def used() -> dict:
        found = nodes(single, "decode")
        return found[0]["load"] if found else {}

    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: httpx.post(single.url + "/v1/completions", json=body, timeout=120).text)
        wait_for(lambda: used().get("used_blocks", 0) >= 30, 60, "the decode to hold the request's blocks")
        os.killpg(decode, signal.SIGSTOP)
        try:
            wait_for(lambda: not nodes(single, "decode"), 20, "the frozen decode to be declared dead")
        finally:
            os.killpg(decode, signal.SIGCONT)
        back = time.monotonic()
        wait_for(lambda: used() and used()["used_blocks"] == 0 and used()["sequences"] == 0, 30,
                 "the returned decode's pool to be free")
        assert time.monotonic() - back < 30


def test_a_prefill_back_from_being_declared_dead_announces_its_device_cache_again(single):
    assert complete(single.url, list(range(4000, 4160)), max_tokens=2).status_code == 200  # 10 blocks
    wait_for(lambda: nodes(single, "prefill")[0]["blocks_indexed"] >= 10, 10, "the prefill's blocks indexed")
    prefill = single.children["prefill0"].pid
    os.killpg(prefill, signal.SIGSTOP)
    try:
        wait_for(lambda: not nodes(single, "prefill"), 20, "the frozen prefill to be declared dead")
    finally:
        os.killpg(prefill, signal.SIGCONT)
    wait_for(lambda: (lambda p: p and p[0]["blocks_indexed"] >= 10)(nodes(single, "prefill")), 30,
             "the returned prefill's device cache in the index again")


def test_only_decode_killed_mid_stream_ends_with_an_error_event_and_done(single):
    body = {"model": MODEL, "prompt": "Write a long story about a dragon", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    text, events = stream_killing(single, body, 3, lambda: decode_child(single))
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-2] is errors[0], events[-3:]
    assert errors[0]["error"]["code"] == "worker_failed" and "decode" in errors[0]["error"]["message"]
    assert time.monotonic() - t0 < 60  # ended by failure detection, not by a client timeout
    wait_for(lambda: httpx.get(single.url + "/cluster").json()["requests"] == 0, 10, "the request to be freed")


def test_sigterm_on_a_worker_drains_its_requests_and_takes_no_new_work(tmp_path):
    """A decode instance told to stop finishes the stream it is serving, gets no new
    request meanwhile, and exits 0."""
    c = _start(tmp_path, prefill=1, decode=1, store=1)
    try:
        body = {"model": MODEL, "prompt": list(range(2000, 2100)), "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}

        def on_event(n: int, _: object) -> None:
            if n == 3:
                os.killpg(c.children["decode0"].pid, signal.SIGTERM)
                wait_for(lambda: httpx.get(c.url + "/health").json()["nodes"]["decode"] == 0, 10,
                         "the draining decode to leave the schedulable set")
                refused = complete(c.url, "Hello", max_tokens=2)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_workers"

        events = stream(c.url, body, on_event)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
        assert events[-2]["usage"]["completion_tokens"] == 40
        assert c.children["decode0"].wait(timeout=30) == 0
    finally:
        c.stop()


def test_sigterm_on_a_store_says_leave_before_it_drains(tmp_path):
    """A store told to stop tells the conductor first (it is listed draining, so fetch plans stop
    naming it), then persists and exits 0; it is not merely found silent later."""
    c = _start(tmp_path, prefill=1, decode=1, store=1)
    try:
        assert complete(c.url, "Hello there", max_tokens=2).status_code == 200
        os.killpg(c.children["store0"].pid, signal.SIGTERM)

        def store_draining() -> bool:
            stores = [n for n in httpx.get(c.url + "/cluster").json()["nodes"] if n["role"] == "store"]
            return bool(stores) and stores[0]["draining"]

        wait_for(store_draining, 20, "the store to be listed draining")
        assert c.children["store0"].wait(timeout=60) == 0
        assert complete(c.url, "Hello there", max_tokens=2).status_code == 200  # served without it
    finally:
        c.stop()
