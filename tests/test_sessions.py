"""Sessions (issue 32): a request naming a session has its prefix kept ``[classes] session_ttl_s``
after its turn, evicted after every block no session keeps, in the engine's prefix cache, in every
store tier, and where the conductor finds it held."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.conductor.session_keeper import SessionKeeper
from mooncake.engine.kv_cache import BlockManager
from mooncake.tiers.device import DeviceTier
from mooncake.tiers.dram import DramTier
from mooncake.tiers.lru import LRU
from mooncake.tiers.tiered import TieredStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def cache(bm: BlockManager, hashes: list[BlockHash], keep_s: float = 0.0, flex: bool = False) -> None:
    """A request computes these blocks and finishes."""
    got = bm.allocate(len(hashes), flex=flex)
    assert got is not None
    bm.register(got, hashes)
    bm.release(got, keep_s)
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
    engine = SimpleNamespace(blocks=bm, num_blocks=4, _num_seqs=0)
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

        async def keep(self, hashes: list[bytes], keep_s: float) -> int:
            kept.append((self.endpoint, hashes, keep_s))
            return len(hashes)

    keeper = SessionKeeper(cluster, SimpleNamespace(holders=lambda x: held[x]), Client)
    submit = P.Submit("w", "f", [], [h(1), h(2), h(3)], b"", P.Sampling(keep_s=30.0), n_tokens=48, new_request=True)
    keeper.turn(submit)
    await asyncio.sleep(0)
    assert sorted(kept) == [("tcp://s0", [h(1), h(2)], 30.0), ("tcp://s1", [h(2)], 30.0)]
    kept.clear()
    keeper.turn(P.Submit("w2", "f", [], [h(1)], b"", P.Sampling(), n_tokens=16, new_request=True))
    await asyncio.sleep(0)
    assert not kept  # no session: nothing kept
