"""Sessions (issue 32): a request naming a session has its prefix kept ``[classes] session_ttl_s``
after its turn, evicted after every block no session keeps, in the engine's prefix cache, in every
store tier, and where the conductor finds it held; each tenant (API key) keeps at most ``[classes]
session_blocks_per_key`` blocks at once in each (issue 51)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.conductor.session_keeper import SessionKeeper
from mooncake.engine.kv_cache import BlockManager
from mooncake.kv.integrity import Rejections, checksums
from mooncake.tenant_quota import TenantQuota
from mooncake.tiers.memory import DeviceTier, DramTier
from mooncake.tiers.lru import LRU
from mooncake.tiers.block_placement import OTHER
from mooncake.tiers.store_requests import StoreRequests
from mooncake.tiers.tiered import TieredStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def cache(bm: BlockManager, hashes: list[BlockHash], keep_s: float = 0.0, flex: bool = False,
          tenant: str = "") -> None:
    """A request (of ``tenant``) computes these blocks and finishes."""
    got = bm.allocate(len(hashes), flex=flex)
    assert got is not None
    bm.register(got, hashes)
    bm.release(got, keep_s, tenant)
    bm.check()


def test_a_sessions_prefix_outlives_a_flood_in_the_prefix_cache_until_its_time_is_up():
    clock = Clock()
    bm = BlockManager(8, clock=clock)
    session = [h(1), h(2)]
    cache(bm, session, keep_s=60)
    cache(bm, [h(3)])  # a prefix no session keeps
    for i in range(20):  # a flood of unique prompts, interactive and flex, all newer than the session's turn
        cache(bm, [h(100 + 2 * i), h(101 + 2 * i)], flex=i % 2 == 1)
        assert bm.cached_prefix(session) == 2
    assert bm.cached_prefix([h(3)]) == 0 and bm.evicted["session"] == 0
    assert len(bm.session_lru) == 2 and bm.kept_until[bm.cached[h(1)]] == 160
    # another request reusing the prefix without a session leaves it kept as long as the session asked
    blocks = bm.acquire(session)
    bm.release(blocks)
    assert len(bm.session_lru) == 2 and not set(blocks) & set(bm.lru)
    # all the room taken: the session's blocks go last
    got = bm.allocate(8)
    assert got is not None and bm.evicted["session"] == 2
    bm.release(got)
    cache(bm, session, keep_s=60)
    cache(bm, [h(600 + i) for i in range(6)])  # the rest of the room, newer
    clock.now += 61  # its time is up: the oldest of the rest, evicted first (the chain's tail first)
    cache(bm, [h(700)])
    assert bm.cached_prefix(session) == 1 and not bm.session_lru and bm.cached_prefix([h(600)]) == 1
    bm.check()


def test_a_sessions_time_stays_with_a_block_another_request_releases_last():
    clock = Clock()
    bm = BlockManager(4, clock=clock)
    cache(bm, [h(1)])
    shared = bm.acquire([h(1)])  # a plain request holds the system prompt ...
    session = bm.acquire([h(1)])  # ... and a session's turn holds it too, and ends first
    bm.release(session, keep_s=60)
    bm.release(shared)
    assert list(bm.session_lru) == shared and bm.kept_until[shared[0]] == 160
    bm.check()


def test_kept_blocks_expire_by_their_own_time_whatever_order_they_were_kept_in():
    clock = Clock()
    lru = LRU(clock)
    lru.add(b"late", 1, until=200)
    lru.add(b"soon", 1, until=110)  # kept after, due first (a demoted block keeps its older time)
    clock.now = 150
    assert list(lru) == [b"soon", b"late"] and lru.kept_blocks() == 1 and lru.oldest() == b"soon"


def test_a_tier_keeps_a_sessions_blocks_last_and_in_the_order_they_expire():
    clock = Clock()
    lru = LRU(clock)
    lru.add(b"c", 1, until=120)
    lru.add(b"b", 1)
    lru.add(b"f", 1, flex=True)
    lru.add(b"a", 1, until=130)
    assert list(lru) == [b"f", b"b", b"c", b"a"] and lru.kept_blocks() == 2
    lru.touch(b"c")  # kept ones stay in the order they expire
    assert list(lru)[-2:] == [b"c", b"a"]
    clock.now = 125  # c's time is up: now the oldest of the ordinary ones
    assert list(lru) == [b"f", b"c", b"b", b"a"] and lru.kept_blocks() == 1
    assert lru.remove(b"a") == 1 and lru.total_bytes == 3 and lru.kept_blocks() == 0
    lru.add(b"d", 1, until=100)  # a time already past: not kept
    assert lru.kept_blocks() == 0 and lru.oldest() == b"f"


def test_session_bookkeeping_stays_bounded_by_the_blocks_kept_not_by_the_turns():
    """1,000 blocks kept under 100,000 session turns: the deadlines stay under twice the blocks
    (each turn left one entry behind, 101,000 in all, before), and the blocks still expire."""
    clock = Clock()
    bm, lru = BlockManager(1000, clock=clock), LRU(clock)
    hashes = [h(i) for i in range(1000)]
    cache(bm, hashes, keep_s=600)
    most = 0
    for turn in range(100_000):
        held = bm.acquire([hashes[turn % 1000]])
        clock.now += 0.001
        bm.release(held, keep_s=600)
        lru.add(bytes(hashes[turn % 1000]), 1, until=clock.now + 600)
        most = max(most, len(bm._deadlines), len(lru._deadlines))
    assert most < 2 * 1000
    bm.check()
    clock.now += 601
    assert lru.kept_blocks() == 0 and len(lru) == 1000
    assert bm.allocate(1) is not None and not bm.session_lru and len(bm.lru) == 999
    bm.check()


def test_a_failed_acquire_takes_no_reference_and_stats_change_no_block():
    """The race of finding 5: expiry ran on the event loop (every heartbeat read the engine's
    stats) while the engine thread acquired; an acquire that failed half-way kept the references
    it had taken. Now reading stats changes nothing, and an acquire that fails gives back all."""
    from mooncake.engine.engine import Engine

    clock = Clock()
    bm = BlockManager(4, clock=clock)
    cache(bm, [h(1), h(2)], keep_s=60)
    clock.now += 61
    engine = SimpleNamespace(blocks=bm, num_blocks=4, _num_seqs=0, speculation=None)
    Engine.stats(engine)  # type: ignore[arg-type]
    assert len(bm.session_lru) == 2  # not expired off the engine thread
    segment = bm._segment
    bm._segment = lambda b, name="": segment(b, name) if b == bm.cached[h(1)] else {}  # the second one's is gone
    try:
        bm.acquire([h(1), h(2)])
    except KeyError:
        pass
    bm._segment = segment
    assert bm.ref == [0, 0, 0, 0]
    bm.check()


def blk(v: float) -> torch.Tensor:
    return torch.full((256,), float(v))  # 1 KiB


def test_a_store_keeps_a_sessions_blocks_through_a_flood_and_keep_extends_them():
    s = TieredStore([DeviceTier(2 * 1024, "cpu"), DramTier(2 * 1024)])
    turn = [bytes([1]) * 32, bytes([2]) * 32]
    assert s.put_many(turn, [blk(1), blk(2)], keep_s=600) == 2
    old = bytes([3]) * 32
    assert s.put_many([old], [blk(3)]) == 1
    assert s.keep([old, bytes([9]) * 32], 600) == 1  # the conductor's Keep: what the store holds
    for i in range(10, 30):
        s.put_many([bytes([i]) * 32], [blk(i)], flex=i % 2 == 0)
        s.check_invariants()
    assert [s.tier_of(k) for k in (*turn, old)] == ["device", "device", "dram"]
    snap = {t["name"]: t for t in s.snapshot()["tiers"]}
    assert (snap["device"]["session_blocks"], snap["dram"]["session_blocks"]) == (2, 1)
    assert s.put_many([bytes([40]) * 32], [blk(40)], keep_s=float("inf")) == 1  # bounded: MAX_KEEP_S
    assert s.placement.kept[bytes([40]) * 32] < float("inf")
    s.close()


async def test_the_conductor_has_the_stores_holding_a_sessions_prefix_keep_it():
    held = {h(1): ["s0", "p0"], h(2): ["s0", "s1"], h(3): []}
    cluster = SimpleNamespace(of_role=lambda role: [SimpleNamespace(node_id=n, endpoints={"store": f"tcp://{n}"})
                                                    for n in ("s0", "s1")])
    kept: list = []

    class Client:
        def __init__(self, endpoint: str) -> None:
            self.endpoint = endpoint

        async def keep(self, hashes: list[bytes], keep_s: float, tenant: str = "") -> int:
            kept.append((self.endpoint, hashes, keep_s, tenant))
            return len(hashes)

    keeper = SessionKeeper(cluster, SimpleNamespace(holders=lambda x: held[x]), Client)
    submit = P.Submit("w", "f", [], [h(1), h(2), h(3)], b"", P.Sampling(keep_s=30.0, tenant="t1"), n_tokens=48,
                      new_request=True)
    keeper.turn(submit)
    await asyncio.sleep(0)
    assert sorted(kept) == [("tcp://s0", [h(1), h(2)], 30.0, "t1"), ("tcp://s1", [h(2)], 30.0, "t1")]
    kept.clear()
    keeper.turn(P.Submit("w2", "f", [], [h(1)], b"", P.Sampling(), n_tokens=16, new_request=True))
    await asyncio.sleep(0)
    assert not kept  # no session: nothing kept


# ---------------------------------------------------------------- quotas per tenant (issue 51)


def test_a_tenant_past_its_quota_has_its_oldest_kept_blocks_become_ordinary_in_the_prefix_cache():
    clock = Clock()
    bm = BlockManager(8, clock=clock, session_blocks_per_key=2)
    cache(bm, [h(50)], keep_s=60, tenant="b")
    cache(bm, [h(1), h(2)], keep_s=60, tenant="a")  # released tail first: h(2) is a's oldest
    cache(bm, [h(5)])  # an ordinary block, used after
    cache(bm, [h(3)], keep_s=60, tenant="a")  # one past a's quota
    assert bm.keepers.counts() == {"a": 2, "b": 1}
    assert set(bm.session_lru) == {bm.cached[x] for x in (h(50), h(1), h(3))}
    assert next(iter(bm.lru)) == bm.cached[h(2)] and bm.cached[h(2)] not in bm.kept_until  # the oldest ordinary one
    got = bm.allocate(4)  # the 3 free ones and one evicted: a's block past its quota, first
    assert got is not None and bm.cached_prefix([h(2)]) == 0 and bm.cached_prefix([h(5)]) == 1
    assert bm.evicted == {"flex": 0, "other": 1, "session": 0}
    bm.release(got)
    bm.check()


def test_a_tenants_flood_of_kept_prompts_never_displaces_another_tenants_kept_prefix():
    """Without a quota every kept block is evicted in the order kept: a flood of new session prompts
    pushes out the oldest, another tenant's prefix. With one, the flood keeps at most its quota."""
    bm = BlockManager(8, clock=Clock(), session_blocks_per_key=2)
    cache(bm, [h(50), h(51)], keep_s=60, tenant="b")
    for i in range(20):
        cache(bm, [h(100 + 2 * i), h(101 + 2 * i)], keep_s=60, tenant="a")
        assert bm.cached_prefix([h(50), h(51)]) == 2 and bm.keepers.counts() == {"a": 2, "b": 2}
    assert bm.evicted["session"] == 0


def test_a_kept_block_belongs_to_the_tenant_that_kept_it_last_until_it_leaves():
    clock = Clock()
    bm = BlockManager(8, clock=clock, session_blocks_per_key=2)
    cache(bm, [h(1)], keep_s=60, tenant="a")
    bm.release(bm.acquire([h(1)]), keep_s=60, tenant="b")  # b's turn reuses a's prefix: b's now
    assert bm.keepers.counts() == {"b": 1}
    shared, held = bm.acquire([h(1)]), bm.acquire([h(1)])
    bm.release(held, keep_s=60, tenant="a")  # in use by another: kept for a once released
    assert bm.keepers.counts() == {"a": 1}
    bm.check()
    cache(bm, [h(2)], keep_s=60, tenant="a")
    cache(bm, [h(3)], keep_s=60, tenant="a")  # past a's quota: h(1), still in use, is kept no longer
    assert bm.cached[h(1)] not in bm.kept_until and bm.keepers.counts() == {"a": 2}
    bm.release(shared)  # a plain request releases it last: ordinary
    assert bm.cached[h(1)] in bm.lru
    bm.check()
    assert bm.forget([h(2)]) == 1 and bm.keepers.counts() == {"a": 1}  # removed
    clock.now += 61
    assert bm.allocate(1) is not None and bm.keepers.counts() == {} and not bm.kept_until  # expired
    bm.check()


def test_no_quota_keeps_every_block_a_tenant_keeps():
    bm = BlockManager(64, clock=Clock(), session_blocks_per_key=0)
    cache(bm, [h(i) for i in range(50)], keep_s=60, tenant="a")
    assert len(bm.session_lru) == 50 and bm.keepers.counts() == {"a": 50}
    lru = LRU(Clock(), TenantQuota(0))
    assert all(lru.add(bytes([i]), 1, until=200, tenant="a") == [] for i in range(50))
    assert lru.kept_blocks() == 50
    lru.check()


def test_ownership_bookkeeping_is_bounded_by_the_blocks_kept_not_by_the_tenants_seen():
    clock = Clock()
    bm, lru = BlockManager(16, clock=clock, session_blocks_per_key=4), LRU(clock, TenantQuota(4))
    for turn in range(5000):  # a new tenant every turn, each keeping a new block
        cache(bm, [h(1000 + turn)], keep_s=60, tenant=f"t{turn}")
        lru.add(bytes(h(1000 + turn)), 1, until=clock.now + 60, tenant=f"t{turn}")
        if len(lru) > 16:
            lru.remove(lru.oldest())  # evicted
        assert len(bm.keepers) <= 16 and len(bm.keepers.counts()) <= 16
        assert len(lru.keepers) <= 16 and len(lru.keepers.counts()) <= 16
        clock.now += 0.01
    bm.check()
    lru.check()
    clock.now += 61
    assert bm.allocate(1) is not None and len(bm.keepers) == 0
    assert lru.kept_blocks() == 0 and len(lru.keepers) == 0 and lru.keepers.counts() == {}


def test_a_tier_makes_a_tenants_oldest_kept_keys_ordinary_past_its_quota():
    clock = Clock()
    lru = LRU(clock, TenantQuota(2))
    lru.add(b"b1", 1, until=200, tenant="b")
    lru.add(b"o", 1)
    assert lru.add(b"a1", 1, until=200, tenant="a") == lru.add(b"a2", 1, until=200, tenant="a") == []
    assert lru.add(b"a3", 1, until=200, tenant="a") == [b"a1"]  # now the oldest of the ordinary ones
    assert list(lru) == [b"a1", b"o", b"b1", b"a2", b"a3"] and lru.keepers.counts() == {"b": 1, "a": 2}
    assert lru.add(b"a2", 1, until=300, tenant="b") == []  # b keeps it now
    assert lru.keepers.counts() == {"b": 2, "a": 1}
    assert lru.add(b"b4", 1, until=300, tenant="b") == [b"b1"]
    assert list(lru)[:3] == [b"b1", b"a1", b"o"]
    lru.check()
    assert lru.remove(b"a3") == 1 and lru.keepers.counts() == {"b": 2}
    clock.now = 301
    assert lru.kept_blocks() == 0 and lru.keepers.counts() == {}
    lru.check()


def test_a_store_holds_each_tenant_to_its_quota_over_all_tiers_and_keep_moves_ownership():
    s = TieredStore([DeviceTier(2 * 1024, "cpu"), DramTier(6 * 1024)], session_blocks_per_key=3)
    k = [bytes([i]) * 32 for i in range(40)]
    assert s.put_many(k[:1], [blk(0)], keep_s=600, tenant="b") == 1
    assert s.put_many(k[1:4], [blk(1), blk(2), blk(3)], keep_s=600, tenant="a") == 3  # into dram as they push
    assert s.put_many(k[4:5], [blk(4)], keep_s=600, tenant="a") == 1  # a's oldest, k[1], becomes ordinary
    s.check_invariants()
    assert s.snapshot()["kept_by_tenant"] == {"b": 1, "a": 3}
    assert k[1] not in s.placement.kept and s.placement.level(k[1]) == OTHER
    for i in range(10, 20):  # a flood of ordinary blocks displaces k[1], never a kept block
        assert s.put_many([k[i]], [blk(i)]) == 1
        s.check_invariants()
    assert s.tier_of(k[1]) is None and all(s.tier_of(x) for x in (k[0], k[2], k[3], k[4]))
    assert s.keep([k[2]], 600, tenant="b") == 1  # b's turn reuses a's block: b's now
    assert s.snapshot()["kept_by_tenant"] == {"b": 2, "a": 2}
    s.check_invariants()
    s.remove([k[0]])
    assert s.snapshot()["kept_by_tenant"] == {"b": 1, "a": 2}
    s.close()


def test_a_tenant_with_a_key_keeps_at_most_its_share_of_a_cache_the_one_tenant_without_keys_all():
    """``session_share_per_key``: the quota is the smaller of the count and the share of the cache's
    capacity (engine: its blocks; store: its bytes over the kept block's size), for tenants with a key."""
    bm = BlockManager(16, clock=Clock(), session_blocks_per_key=100, session_share_per_key=0.25)
    for i in range(8):
        cache(bm, [h(100 + i)], keep_s=60, tenant="key-a")
        cache(bm, [h(200 + i)], keep_s=60, tenant="")
    assert bm.keepers.counts() == {"key-a": 4, "": 8}  # a quarter of 16 blocks; no keys: the count only
    bm.check()
    s = TieredStore([DramTier(16 * 1024)], session_blocks_per_key=3, session_share_per_key=0.5)
    k = [bytes([i]) * 32 for i in range(12)]
    for i in range(6):
        assert s.put_many(k[i:i + 1], [blk(i)], keep_s=600, tenant="key-a") == 1
    assert s.snapshot()["kept_by_tenant"] == {"key-a": 3}  # the count is the smaller: 3 < 16 KiB / 1 KiB / 2
    s.placement.keepers.quota = 0
    for i in range(6, 12):
        assert s.put_many(k[i:i + 1], [blk(i)], keep_s=600, tenant="key-a") == 1
    assert s.snapshot()["kept_by_tenant"] == {"key-a": 8}  # half of the 16 blocks the store holds
    s.check_invariants()
    s.close()


def test_the_store_messages_carry_the_tenant_and_old_ones_still_decode():
    seg = P.ShmRef(0, P.TensorSpec("float32", (2,)))
    for msg in (P.Put([b"k"], [], keep_s=5.0, tenant="t1"), P.Keep([b"k"], 5.0, tenant="t1"),
                P.ShmPut([b"k"], "seg", [seg], keep_s=5.0, tenant="t1")):
        back, _ = P.decode(P.encode(msg))
        assert back == msg and back.tenant == "t1"
    old = msgspec.msgpack.encode({"t": "keep", "hashes": [b"k"], "keep_s": 5.0})  # from a sender before tenants
    assert P.decode([old])[0] == P.Keep([b"k"], 5.0, tenant="")


async def test_a_put_and_a_keep_keep_blocks_for_their_tenant_in_the_store():
    store = TieredStore([DramTier(8 * 1024)], session_blocks_per_key=1)
    requests = StoreRequests(store, Rejections(), workers=1)
    try:
        await requests.handle(P.Put([b"a" * 32], [], checksums=checksums([blk(1)]), keep_s=60, tenant="t1"), [blk(1)])
        await requests.handle(P.Put([b"b" * 32], [], checksums=checksums([blk(2)]), keep_s=60, tenant="t2"), [blk(2)])
        assert store.snapshot()["kept_by_tenant"] == {"t1": 1, "t2": 1}
        await requests.handle(P.Keep([b"a" * 32], 60, tenant="t2"), [])  # t2 past its quota: its oldest goes
        assert store.snapshot()["kept_by_tenant"] == {"t2": 1} and store.placement.keeper == {b"a" * 32: "t2"}
    finally:
        requests.close()
        store.close()


async def test_a_worker_writes_back_and_releases_a_sessions_blocks_for_its_tenant():
    from mooncake.config import SecurityConfig
    from mooncake.engine.engine import Engine
    from mooncake.kv.store_clients import StoreClients

    puts: list[dict] = []

    class Client:
        async def put(self, hashes, kv, model_id, **kw) -> int:
            puts.append(kw)
            return len(hashes)

    stores = StoreClients(None, 16 << 20, None, SecurityConfig())
    stores.client = lambda endpoint: Client()  # type: ignore[method-assign]
    stores.write_back("tcp://s", [b"k" * 32], blk(1).view(1, -1), keep_s=60, tenant="t1")
    await asyncio.gather(*stores.writes)
    assert puts[0]["tenant"] == "t1" and puts[0]["keep_s"] == 60

    bm = BlockManager(4, clock=Clock(), session_blocks_per_key=2)
    blocks = bm.allocate(2)
    bm.register(blocks, [h(1), h(2)])
    seq = SimpleNamespace(freed=False, block_table=blocks, sampling=P.Sampling(keep_s=60, tenant="t1"))
    Engine.free(SimpleNamespace(blocks=bm, _num_seqs=1), seq)  # type: ignore[arg-type]
    assert bm.keepers.counts() == {"t1": 2}
    bm.check()


async def test_the_cluster_shows_each_tenants_share_of_the_attempts_and_the_blocks_it_keeps():
    from mooncake.conductor import Conductor
    from mooncake.conductor.snapshot import cluster_snapshot
    from mooncake.config import Config

    async def flush() -> None:
        pass

    c = Conductor(Config(), model_name="m")
    c.router = SimpleNamespace(send=lambda node_id, msg: None, flush=flush, close=lambda: None)
    try:
        for node_id, role, kept, endpoints in (("p0", "prefill", {"t1": 3, "": 1}, {"orders": "tcp://127.0.0.1:3"}),
                                               ("s0", "store", {"t1": 5, "t2": 2}, {"store": "tcp://127.0.0.1:7"}),
                                               ("f0", "frontend", {}, {"tokens": "tcp://127.0.0.1:9"})):
            facts = P.ModelFacts("m@x/float32", 16, 128, 1000, (2, 2, 1, 16, 8)) if role == "prefill" else None
            c.membership.register(node_id.encode(), P.Register(role, node_id, P.NodeInfo("n0", 1, facts), endpoints), 0.0)
            written, dropped = ({"t2": 4096}, {"t2": 1024}) if role == "store" else ({}, {})
            c.membership.heartbeat(c.cluster.get(node_id), P.Load(kept_by_tenant=kept, written_by_tenant=written,
                                                                  dropped_by_tenant=dropped), 0.0)
        for i, tenant in enumerate(("t1", "t1", "t1", "t3")):  # attempts placed and not ended
            c.attempts[f"r{i}#1"] = SimpleNamespace(submit=SimpleNamespace(sampling=P.Sampling(tenant=tenant)))
        snap = cluster_snapshot(c)
        assert snap["tenants"] == {"t1": {"attempts": 3, "share": 0.75, "kept_blocks": 8, "store_bytes": 0},
                                   "t3": {"attempts": 1, "share": 0.25, "kept_blocks": 0, "store_bytes": 0},
                                   "": {"attempts": 0, "share": 0.0, "kept_blocks": 1, "store_bytes": 0},
                                   "t2": {"attempts": 0, "share": 0.0, "kept_blocks": 2, "store_bytes": 4096}}
        text = c.metrics.render().decode()
        assert 'mooncake:tenant_kept_blocks{node="s0",tenant="t1"} 5.0' in text
        assert 'mooncake:tenant_store_bytes_total{node="s0",outcome="dropped",tenant="t2"} 1024.0' in text
        c.membership.heartbeat(c.cluster.get("s0"), P.Load(kept_by_tenant={"t2": 1}), 1.0)  # t1 keeps none there now
        assert 'mooncake:tenant_kept_blocks{node="s0",tenant="t1"} 0.0' in c.metrics.render().decode()
        c.attempts.clear()
        by_node = {n["node_id"]: n["load"]["kept_by_tenant"] for n in snap["nodes"]}
        assert by_node == {"p0": {"t1": 3, "": 1}, "s0": {"t1": 5, "t2": 2}, "f0": {}}
    finally:
        await c.close()
