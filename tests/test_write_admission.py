"""Reuse-aware store writes (issue 33): a new chain goes to the store once it recurs (or for a
session, or while the workload reuses), not on its first sighting otherwise; the prefill writes
the range the conductor names, from its device cache too."""

from __future__ import annotations

import os
from types import SimpleNamespace

import httpx
import pytest

from mooncake import protocol as P
from mooncake.kv.prefill_kv import PrefillKV
from mooncake.metrics import Metrics
from mooncake.sched.admission import Admission
from mooncake.config import AdmissionConfig
from mooncake.sched.placement import place
from mooncake.sched.sightings import Sightings
from mooncake.testing.api import complete, metric, metrics
from mooncake.testing.cluster import SHAPES, running_cluster
from mooncake.testing.wait import wait_for

from test_sched import make

H = [bytes([i, 9]) * 16 for i in range(16)]
OTHER = [bytes([i, 5]) * 16 for i in range(16)]


def test_a_chain_reads_as_sighted_up_to_where_it_first_differs_for_a_generation_or_two():
    s = Sightings(per_generation=100, log2_bits=16)
    chain = [os.urandom(32) for _ in range(10)]
    assert s.seen_run(chain) == 0 and s.seen_run(chain) == 10
    assert s.seen_run(chain[:4] + [os.urandom(32)] + chain[5:]) == 4  # a chain is a prefix: it stops at a change
    ids = [i.to_bytes(8, "little") for i in range(1000)]  # the simulator's keys: small integers
    assert s.seen_run(ids[:50]) == 0 and s.seen_run(ids[:50]) == 50
    s.seen_run(ids[100:220])  # a new generation began: the first one is still remembered
    assert s.seen_run(ids[:50]) == 50
    s.seen_run(ids[300:420])
    s.seen_run(ids[500:620])  # two generations later it is forgotten
    assert s.seen_run(ids[50:60]) == 0
    big = Sightings()
    for _ in range(200):
        big.seen_run([os.urandom(32) for _ in range(100)])
    assert sum(big.seen_run([os.urandom(32)]) for _ in range(20_000)) <= 10  # false positives: rare


def test_a_block_is_written_once_its_prefix_recurs_and_a_new_chain_while_the_workload_reuses():
    sched, cluster, idx = make()
    adm, metrics = Admission(AdmissionConfig(), Metrics()), Metrics()
    adm.metrics = metrics

    def plan_of(req: str, hashes: list[bytes], session: bool = False, first: bool = True):
        booking = place(sched, adm, req, hashes, len(hashes) * 16 + 5, 4, 16, 0.0, session=session, judge=first)
        sched.release(req)
        return booking.plan

    first = plan_of("a", H[:8])  # seen for the first time: it stays in the device cache
    assert first.store_range == (0, 0) and not first.decode_writes and first.store_endpoint
    again = plan_of("b", H[:10])  # mostly a recurring prefix (a conversation going on): all of it,
    assert again.store_range == (0, 10) and again.decode_writes  # from the device cache where it is cached
    store = next(n.node_id for n in cluster.of_role("store") if n.endpoints["store"] == again.store_endpoint)
    idx.add(store, "dram", H[:5])
    assert plan_of("c", H[:10]).store_range == (5, 10)  # from the first block the store lacks
    chat = plan_of("d", H[:12], session=True)
    assert chat.store_range == (5, 12) and chat.decode_writes
    document = plan_of("e", H[:2] + OTHER[2:10])  # a shared system prompt, then a new document:
    assert document.store_range == (2, 2) and not document.decode_writes  # only the recurring part
    fork = plan_of("f", H[:12], first=False)  # another choice or a retry: its first attempt decided
    assert fork.store_range == (0, 0) and not fork.decode_writes
    fresh = plan_of("g", [bytes([i, 3]) * 16 for i in range(6)])  # new, but the workload reuses now:
    assert fresh.store_range == (0, 6) and fresh.decode_writes  # written at once
    counted = {s.labels["decision"]: s.value for m in metrics.store_write_blocks.collect() for s in m.samples
               if s.name.endswith("_total")}
    assert counted == {"written": 10 + 5 + 7 + 6, "skipped": 8 + 8}
    every, _, _ = make(store_writes="all")
    assert place(every, adm, "g", H[:8], 8 * 16 + 5, 4, 16, 0.0).plan.store_range is None


def test_the_prefill_writes_the_range_the_conductor_names():
    def kv(store_range: list[int]) -> SimpleNamespace:  # what PrefillKV's planning reads of itself
        req = P.PrefillRequest("r", [], H[:10], b"", P.Sampling(), "", store_endpoint="tcp://s",
                               store_range=store_range)
        return SimpleNamespace(req=req, hashes=req.hashes)

    legacy = kv([])
    assert PrefillKV.store_start(legacy, 4) == 4 and PrefillKV.save_plan(legacy, 4, 10) == (4, 10)
    recurring = kv([0, 6])  # the first 6 recur and the store lacks them; 4 are in the device cache
    assert PrefillKV.store_start(recurring, 4) == 0 and PrefillKV.save_plan(recurring, 0, 10) == (0, 6)
    assert PrefillKV.save_plan(recurring, 6, 10) == (6, 6)  # nothing past the range
    assert PrefillKV.store_start(kv([6, 10]), 4) == 4  # the device cache lost some: from what it computes
    unseen = kv([0, 0])
    first, end = PrefillKV.save_plan(unseen, PrefillKV.store_start(unseen, 4), 10)
    assert end <= first


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("data"), store_writes="reused", **SHAPES[request.param]) as c:
        yield c


def test_a_served_prompt_reaches_the_store_on_its_second_sighting_from_the_device_cache(cluster):
    def stored() -> int:
        nodes = httpx.get(cluster.url + "/cluster").json()["nodes"]
        return sum(t["blocks"] for n in nodes if n["role"] == "store" for t in n["load"]["tiers"].values())

    def written(decision: str) -> float:
        return metric(metrics(cluster.url), "mooncake:store_write_blocks_total", decision=decision)

    prompt = list(range(3000, 3000 + 16 * 12 + 3))  # 12 full blocks
    first = complete(cluster.url, prompt, max_tokens=4)
    assert first.status_code == 200 and written("skipped") == 12 and written("written") == 0
    second = complete(cluster.url, prompt, max_tokens=4)  # it recurs: written, though the prefill computes none
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    wait_for(lambda: stored() >= 12, 20, "the recurring prompt's blocks in the store")
    assert written("written") == 12 and stored() == 12  # the first request's decode wrote nothing either
