"""Tiers and the tiered store, in-process: LRU, demotion chain, promotion, gate, accounting."""

from __future__ import annotations

import torch
import pytest

from mooncake.tiers.base import StoredBlock
from mooncake.tiers.memory import DeviceTier, DramTier
from mooncake.tiers.lmdb_tier import LmdbTier
from mooncake.tiers.lru import LRU
from mooncake.tiers.tiered import TieredStore

BLOCK = 1024  # bytes of one test block (256 float32)


def blk(v: float, n: int = 256) -> torch.Tensor:
    return torch.full((n,), float(v))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def put(s: TieredStore, k: bytes, t: torch.Tensor) -> bool:
    return s.put_many([k], [t]) == 1


def make(tmp_path, dev=2, dram=2, disk=2, events=None, **kw) -> TieredStore:
    tiers = [DeviceTier(dev * BLOCK, "cpu"), DramTier(dram * BLOCK)]
    if disk:
        tiers.append(LmdbTier(tmp_path / "lmdb", disk * BLOCK))
    sink = (lambda kind, tier, keys: events.append((kind, tier, list(keys)))) if events is not None else None
    return TieredStore(tiers, on_event=sink, **kw)


def test_lru_order():
    lru = LRU()
    for k in (b"a", b"b", b"c"):
        lru.add(k, 1)
    lru.touch(b"a")
    assert list(lru) == [b"b", b"c", b"a"]
    assert lru.oldest() == b"b"
    assert lru.remove(b"c") == 1 and lru.total_bytes == 2
    assert LRU().oldest() is None
    lru.add(b"f", 1, flex=True)
    assert lru.oldest() == b"f" and list(lru) == [b"f", b"b", b"a"] and lru.flex_blocks() == 1
    lru.add(b"f", 1)  # written again, not as flex
    assert lru.oldest() == b"b" and lru.flex_blocks() == 0 and lru.total_bytes == 3


def test_demotion_chain_to_drop(tmp_path):
    events: list = []
    s = make(tmp_path, events=events)
    for i in range(7):
        assert put(s, key(i), blk(i))
    # newest two on device, then dram, then lmdb; the oldest was dropped
    assert [s.tier_of(key(i)) for i in range(7)] == [None, "lmdb", "lmdb", "dram", "dram", "device", "device"]
    assert ("removed", "lmdb", [key(0)]) in events
    assert s.stats.dropped == 1 and s.stats.tiers["device"].demotions == 5
    s.check_invariants()
    got = s.get_many([key(1)])
    assert torch.equal(got[0][1].tensor, blk(1))
    s.close()


def test_a_flex_scan_displaces_flex_blocks_before_an_interactive_prefix_in_every_tier(tmp_path):
    s = make(tmp_path, dev=2, dram=2, disk=2)
    chat = [key(1), key(2)]
    assert s.put_many(chat, [blk(1), blk(2)]) == 2  # an interactive request's prefix
    for i in range(10, 40):  # a flex scan of unique blocks, each written once
        assert s.put_many([key(i)], [blk(i)], flex=True) == 1
        s.check_invariants()
    assert [s.tier_of(k) for k in chat] == ["device", "device"]  # never displaced
    # flex work takes the room left below them: the newest in DRAM, older ones on disk, the rest dropped
    assert [s.tier_of(key(i)) for i in (36, 37, 38, 39)] == ["lmdb", "lmdb", "dram", "dram"]
    dram, device = s.stats.tiers["dram"], s.stats.tiers["device"]
    assert dram.evictions == dram.flex_evictions == 28 and device.evictions == 0 and s.stats.dropped == 26
    snap = {t["name"]: t for t in s.snapshot()["tiers"]}
    assert (snap["device"]["flex_blocks"], snap["dram"]["flex_blocks"], snap["lmdb"]["flex_blocks"]) == (0, 2, 2)
    for i in range(3, 6):  # interactive blocks still displace the least recently used ones
        s.put_many([key(i)], [blk(i)])
    assert [s.tier_of(k) for k in (*chat, key(3), key(4), key(5))] == ["lmdb", "dram", "dram", "device", "device"]
    assert [s.tier_of(key(i)) for i in (36, 37, 38, 39)] == [None, None, None, "lmdb"]  # flex went first
    # a store full of interactive blocks takes no flex block, and keeps no trace of it
    full = make(tmp_path / "full", dev=1, dram=1, disk=0)
    assert full.put_many([key(1), key(2)], [blk(1), blk(2)]) == 2
    assert full.put_many([key(50)], [blk(50)], flex=True) == 0 and key(50) not in full.placement.flex
    full.close()
    # a flex block written by an interactive request too is no longer flex
    assert key(39) in s.placement.flex and s.put_many([key(39)], [blk(39)]) == 1
    assert key(39) not in s.placement.flex and s.tier_of(key(39)) == "device"
    s.check_invariants()
    s.close()


def test_lru_within_tier_respects_recent_use(tmp_path):
    s = make(tmp_path, dev=2, dram=1, disk=0)
    put(s, key(1), blk(1))
    put(s, key(2), blk(2))
    s.get_many([key(1)])  # key 2 is now least recently used on the device
    put(s, key(3), blk(3))
    assert s.tier_of(key(2)) == "dram" and s.tier_of(key(1)) == "device"
    s.close()


def test_promotion_on_hit_and_off(tmp_path):
    s = make(tmp_path)
    for i in range(6):
        put(s, key(i), blk(i))
    assert s.tier_of(key(0)) == "lmdb"
    (k, b), = s.get_many([key(0)])
    assert torch.equal(b.tensor, blk(0)) and s.tier_of(key(0)) == "device"
    assert s.stats.tiers["lmdb"].promotions == 1
    s.check_invariants()
    s.close()
    s2 = make(tmp_path / "b", promote_on_hit=False)
    for i in range(6):
        put(s2, key(i), blk(i))
    s2.get_many([key(0)])
    assert s2.tier_of(key(0)) == "lmdb"
    s2.close()


def test_capacity_never_exceeded_and_oversize_rejected(tmp_path):
    s = make(tmp_path, dev=2, dram=2, disk=0)
    assert not put(s, key(99), torch.zeros(4 * 256))  # bigger than every tier
    for i in range(20):
        put(s, key(i), blk(i, 128 + 64 * (i % 3)))
        for t in s.tiers:
            assert t.used_bytes <= t.capacity_bytes
        s.check_invariants()
    assert s.stats.rejected == 1
    s.close()


def test_gate_keeps_one_shot_blocks_off_ssd(tmp_path):
    s = make(tmp_path, ssd_admission="after_hits", ssd_admission_hits=1)
    for i in range(6):
        put(s, key(i), blk(i))
    s.get_many([key(4)])  # key 4 was read once: worth a disk write later
    for i in range(6, 14):
        put(s, key(i), blk(i))
    on_disk = set(s.tiers[2].keys())
    assert on_disk == {key(4)}
    assert s.tier_of(key(0)) is None  # seen once, dropped from DRAM, never written
    s.close()


def test_reusing_the_last_recycled_tensor_of_a_shape_then_making_room_for_another():
    t = DramTier(1024)
    assert t.put(b"x", StoredBlock(torch.zeros(64))) and t.put(b"y", StoredBlock(torch.zeros(128)))
    t.delete(b"x")
    t.delete(b"y")  # both tensors recycled: 768 bytes on the free lists
    assert t.put(b"z", StoredBlock(torch.ones(64)))  # takes the only [64] tensor
    assert t.put(b"w", StoredBlock(torch.ones(2, 64)))  # a new shape: recycled tensors are dropped for room
    assert torch.equal(t.get(b"w").tensor, torch.ones(2, 64)) and t.used_bytes == 768


def test_recycled_memory_never_overwrites_a_held_tensor():
    t = DramTier(2 * BLOCK)
    t.put(b"a", StoredBlock(blk(1)))
    held = t.get(b"a").tensor  # e.g. a socket still sending it
    t.delete(b"a")
    t.put(b"b", StoredBlock(blk(2)))
    assert torch.equal(held, blk(1))
    # unreferenced tensors are recycled (same memory reused)
    t2 = DramTier(2 * BLOCK)
    t2.put(b"a", StoredBlock(blk(1)))
    ptr = t2.get(b"a").tensor.data_ptr()
    t2.delete(b"a")
    t2.put(b"b", StoredBlock(blk(2)))
    assert t2.get(b"b").tensor.data_ptr() == ptr and torch.equal(t2.get(b"b").tensor, blk(2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
def test_lmdb_roundtrip_dtypes_and_model_id(tmp_path, dtype):
    tier = LmdbTier(tmp_path, 1 << 20)
    x = (torch.randn(2, 2, 3, 4, 8) * 10).to(dtype)
    assert tier.put(b"k", StoredBlock(x, "model-a"))
    assert tier.flush() == []
    got = tier.get(b"k")
    assert got.model_id == "model-a" and got.tensor.dtype == dtype and torch.equal(got.tensor, x)
    tier.close()


def test_lmdb_capacity_enforced(tmp_path):
    tier = LmdbTier(tmp_path, 3 * BLOCK)
    assert all(tier.put(key(i), StoredBlock(blk(i))) for i in range(3))
    assert not tier.put(key(9), StoredBlock(blk(9)))
    tier.flush()
    assert tier.used_bytes == 3 * BLOCK and len(tier) == 3
    tier.close()


def test_corrupt_value_is_a_counted_miss(tmp_path):
    s = make(tmp_path, dev=1, dram=1, disk=4)
    pattern = torch.arange(256, dtype=torch.float32) + 12345.0
    put(s, key(1), pattern)
    put(s, key(2), blk(2))
    put(s, key(3), blk(3))  # key 1 now on disk
    assert s.tier_of(key(1)) == "lmdb"
    s.close()
    data = tmp_path / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(pattern.numpy().tobytes())
    assert at >= 0
    raw[at + 100] ^= 0xFF
    data.write_bytes(bytes(raw))
    s2 = make(tmp_path, dev=1, dram=1, disk=4)
    assert s2.tier_of(key(1)) == "lmdb"  # header intact: found at recovery
    assert s2.get_many([key(1), key(2)], prefix=True) == []
    assert s2.snapshot()["corrupt"] == 1 and s2.tier_of(key(1)) is None
    assert s2.stats.misses == 1
    s2.check_invariants()
    s2.close()


def test_corrupt_header_deleted_at_recovery(tmp_path):
    tier = LmdbTier(tmp_path, 1 << 20)
    tier.put(b"k", StoredBlock(blk(1)))
    tier.close()
    with tier.env.__class__(str(tmp_path), map_size=1 << 24) as env, env.begin(write=True) as txn:
        txn.put(b"k", b"garbage")
    tier2 = LmdbTier(tmp_path, 1 << 20)
    assert len(tier2) == 0 and tier2.corrupt == 1 and tier2.used_bytes == 0
    tier2.close()


def test_events_and_stats(tmp_path):
    events: list = []
    s = make(tmp_path, dev=1, dram=1, disk=0, events=events)
    s.put_many([key(1), key(2), key(3)], [blk(1), blk(2), blk(3)])
    s.get_many([key(2), key(2), key(9)])
    assert ("removed", "dram", [key(1)]) in events
    snap = s.snapshot()
    assert snap["hits"] == 2 and snap["misses"] == 1
    assert snap["hot"][0] == [key(2).hex(), 2]
    assert {t["name"]: t["used_bytes"] for t in snap["tiers"]} == {"device": BLOCK, "dram": BLOCK}
    assert sorted(s.stored()) == sorted([(key(2), "device"), (key(3), "dram")])
