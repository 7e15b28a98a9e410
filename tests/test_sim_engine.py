"""Units of the simulator: event engine, LRU blocks, virtual store tiers, decode batch
arithmetic, trace rescaling, analytic profiles."""

from __future__ import annotations

import pytest

from mooncake.bench.trace import TraceRecord
from mooncake.sched.kv_index import KVIndex
from mooncake.sim.events import EventLoop
from mooncake.sim.instances import DecodeInstance, DecodeSeq, StoreInstance, virtual_node
from mooncake.sim.block_lru import LRUBlocks
from mooncake.sim.profiles import hardware_for
from mooncake.sim.synthetic import concatenate
from mooncake.sim.workload import requests_from_records


def h(i: int) -> bytes:
    return i.to_bytes(8, "little")


def test_events_run_in_time_order_and_ties_in_schedule_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    loop.at(2.0, lambda: seen.append((loop.now, "b")))
    loop.at(1.0, lambda: seen.append((loop.now, "a")))
    loop.at(2.0, lambda: seen.append((loop.now, "c")))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append((loop.now, "nested"))))
    loop.run()
    assert seen == [(1.0, "a"), (1.5, "nested"), (2.0, "b"), (2.0, "c")]
    assert loop.processed == 5 and len(loop) == 0


def test_events_never_run_in_the_past_and_stop_at_until() -> None:
    loop = EventLoop()
    seen: list[float] = []
    loop.at(5.0, lambda: loop.at(1.0, lambda: seen.append(loop.now)))
    loop.at(9.0, lambda: seen.append(loop.now))
    loop.run(until=6.0)
    assert seen == [5.0] and loop.now == 6.0 and len(loop) == 1
    loop.run()
    assert seen == [5.0, 9.0]


def test_lru_evicts_least_recently_used_and_counts_leading_runs() -> None:
    lru = LRUBlocks(3)
    assert lru.insert([h(1), h(2), h(3)]) == ([h(1), h(2), h(3)], [], [])
    assert lru.touch(h(1))
    added, evicted, _ = lru.insert([h(4)])
    assert added == [h(4)] and evicted == [h(2)]
    assert lru.leading_run([h(1), h(3), h(2), h(4)]) == 2
    assert not lru.touch(h(2)) and lru.discard(h(3)) and not lru.discard(h(3))
    assert LRUBlocks(0).insert([h(1)]) == ([], [], [])
    with pytest.raises(ValueError):
        LRUBlocks(-1)


def test_store_demotes_to_lmdb_drops_past_it_and_promotes_on_read() -> None:
    index = KVIndex()
    store = StoreInstance(virtual_node("store-0", "store", "p0"), index, dram_blocks=2, lmdb_blocks=1)
    store.put([h(1), h(2)])
    assert index.holders(h(1)) == {"store-0": "dram"}
    store.put([h(3)])  # h1 -> lmdb
    assert store.tier_of(h(1)) == "lmdb" and index.holders(h(1)) == {"store-0": "lmdb"}
    store.put([h(4)])  # h2 -> lmdb, h1 dropped
    assert store.tier_of(h(1)) is None and index.holders(h(1)) == {}
    store.read(h(2))  # promoted; h3 demoted, taking the one SSD slot
    assert store.tier_of(h(2)) == "dram" and store.tier_of(h(3)) == "lmdb"
    assert index.holders(h(2)) == {"store-0": "dram"} and index.holders(h(3)) == {"store-0": "lmdb"}
    assert index.blocks_of("store-0") == 3


def test_flex_blocks_displace_only_flex_blocks_and_the_index_follows() -> None:
    index = KVIndex()
    store = StoreInstance(virtual_node("store-0", "store", "p0"), index, dram_blocks=2, lmdb_blocks=2)
    store.put([h(1)], flex=True)
    store.put([h(2), h(3)])  # the flex block goes first, to SSD
    assert store.tier_of(h(1)) == "lmdb" and store.tier_of(h(2)) == store.tier_of(h(3)) == "dram"
    store.put([h(4)], flex=True)  # no flex block in DRAM to displace: not held
    assert store.tier_of(h(4)) is None and index.holders(h(4)) == {}
    store.read(h(1), flex=True)  # a flex read cannot promote it past interactive blocks: it stays
    assert store.tier_of(h(1)) == "lmdb" and index.holders(h(1)) == {"store-0": "lmdb"}
    store.read(h(1))  # an interactive read promotes it (no longer flex)
    assert store.tier_of(h(1)) == "dram" and index.holders(h(1)) == {"store-0": "dram"}
    lru = LRUBlocks(2)
    lru.insert([h(5)], flex=True)
    assert lru.is_flex(h(5)) and lru.leading_run([h(5)]) == 1 and not lru.is_flex(h(5))  # used by another


def test_store_without_lmdb_forgets_what_dram_evicts() -> None:
    index = KVIndex()
    store = StoreInstance(virtual_node("store-0", "store", "p0"), index, dram_blocks=1, lmdb_blocks=0)
    store.put([h(1), h(2)])
    assert index.holders(h(1)) == {} and index.holders(h(2)) == {"store-0": "dram"}


def test_decode_batch_advances_every_sequence_by_the_steps_elapsed() -> None:
    d = DecodeInstance(virtual_node("decode-0", "decode", "d0"), kv_capacity=100, max_batch=2)
    a, b = DecodeSeq("a", 10.0, 40.0, 50), DecodeSeq("b", 4.0, 20.0, 30)
    assert d.fits(a)
    d.active["a"], d.kv_reserved = a, 50
    assert d.fits(b)
    d.active["b"] = b
    d.kv_reserved += 30
    assert not d.fits(DecodeSeq("c", 1.0, 1.0, 1))  # batch full
    d.step_s = 0.5
    gaps: list[tuple[float, float]] = []
    d.advance(2.0, gaps)
    assert a.remaining == 6.0 and b.remaining == 0.0 and a.kv_tokens == 44.0
    assert gaps == [(0.5, 8.0)]


def test_empty_decode_instance_takes_a_sequence_larger_than_its_pool() -> None:
    d = DecodeInstance(virtual_node("decode-0", "decode", "d0"), kv_capacity=10, max_batch=4)
    assert d.fits(DecodeSeq("big", 5.0, 100.0, 105))


def _rec(i: int, ts: float, ids: tuple[int, ...], n: int | None = None) -> TraceRecord:
    return TraceRecord(i, ts, n if n is not None else len(ids) * 512, 10, ids)


def test_trace_rescaling_rate_time_and_reuse() -> None:
    recs = [_rec(1, 0, (0, 1, 2)), _rec(2, 1000, (0, 1, 2, 3)), _rec(3, 4000, (0, 5), 600)]
    base = requests_from_records(recs)
    assert [r.arrival_s for r in base] == [0.0, 1.0, 4.0]
    assert base[1].hashes[:3] == base[0].hashes and base[2].prompt_tokens == 600 and len(base[2].hashes) == 1
    assert [r.arrival_s for r in requests_from_records(recs, rate_scale=2.0, time_scale=3.0)] == [0.0, 1.5, 6.0]
    none = requests_from_records(recs, reuse_scale=0.0)
    assert not set(none[1].hashes) & set(none[0].hashes) and not set(none[2].hashes) & set(none[0].hashes)
    half = requests_from_records(recs, reuse_scale=0.5)
    assert half[1].hashes[:1] == base[1].hashes[:1] and half[1].hashes[1] != base[1].hashes[1]
    small = requests_from_records(recs, block_tokens=16)
    assert small[0].prompt_tokens == 48 and len(small[0].hashes) == 3
    assert len(requests_from_records(recs, max_requests=2)) == 2
    for bad in ({"rate_scale": 0.0}, {"reuse_scale": 1.5}, {"block_tokens": 0}):
        with pytest.raises(ValueError):
            requests_from_records(recs, **bad)


def test_concatenated_copies_share_nothing_and_follow_each_other() -> None:
    recs = [_rec(1, 0, (0, 1)), _rec(2, 500, (0, 2))]
    out = concatenate(recs, 3, gap_ms=100)
    assert [r.timestamp_ms for r in out] == [0, 500, 600, 1100, 1200, 1700]
    assert out[2].hash_ids == (3, 4) and out[4].hash_ids == (6, 7)


def test_analytic_profile_costs_grow_with_work() -> None:
    hw = hardware_for("a800x8-llama2-70b", 512)
    assert hw.prefill_s(8192, 0) < hw.prefill_s(8192, 32768) < hw.prefill_s(16384, 32768)
    assert hw.decode_step_s(1, 1000) < hw.decode_step_s(64, 64 * 8000)
    assert hw.fetch_block_s("dram", True) < hw.fetch_block_s("lmdb", True)
    assert hw.fetch_block_s("dram", True) * 20 < hw.prefill_s(512, 0)  # a cached block beats recomputing it
    assert hw.caps.prefill_cache_blocks > 0 and hw.caps.store_lmdb_blocks > hw.caps.store_dram_blocks
    tps, fixed = hw.prefill_prior()
    assert 1000 < tps < 100000 and fixed > 0
    with pytest.raises(ValueError, match="unknown profile"):
        hardware_for("nope", 512)


def test_scheduler_random_policy_draws_from_its_seeded_rng() -> None:
    import random

    from mooncake.config import ConductorConfig
    from mooncake.sched.node_registry import Cluster
    from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
    from mooncake.sched.scheduler import Scheduler

    def picks(seed: int) -> list[str]:
        cluster = Cluster()
        for i in range(8):
            cluster.upsert(virtual_node(f"prefill-{i}", "prefill", f"p{i}"))
        cluster.upsert(virtual_node("decode-0", "decode", "d0"))
        sched = Scheduler(ConductorConfig(policy="random"), cluster, KVIndex(), PrefillCostModel(), DecodeCostModel(),
                          rng=random.Random(seed))
        return [sched.plan([h(1)], 600, 4, 512, 0.0).prefill.node_id for _ in range(40)]

    a = picks(1)
    assert a == picks(1) and a != picks(2)
    assert len(set(a)) >= 6  # spread over the instances, not stuck on the least loaded one


def test_an_encoded_kv_codec_costs_its_bytes_on_links_and_in_stores_not_in_the_pool() -> None:
    plain, int8 = hardware_for("l4-llama3-8b", 512), hardware_for("l4-llama3-8b", 512, "int8")
    share = (1 + 2 / 16) / 2  # a byte per value and a float16 scale per channel of each 16-token block
    assert int8.fetch_block_s("dram", False) == pytest.approx(plain.fetch_block_s("dram", False) * share)
    assert int8.kv_transfer_s(4096) == pytest.approx(plain.kv_transfer_s(4096) * share)
    assert int8.caps.store_dram_blocks == pytest.approx(plain.caps.store_dram_blocks / share, rel=1e-3)
    assert int8.caps.prefill_cache_blocks == plain.caps.prefill_cache_blocks
    assert int8.caps.decode_kv_tokens == plain.caps.decode_kv_tokens
    assert int8.name == "l4-llama3-8b+kv_int8"
    with pytest.raises(ValueError, match="kv_codec"):
        hardware_for("l4-llama3-8b", 512, "int4")
