"""Block manager and prefix cache accounting, without the model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.blocks import BlockHash
from mooncake.engine.kv_cache import BlockManager


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def test_allocate_exhaustion_returns_none_and_leaks_nothing():
    bm = BlockManager(4)
    a = bm.allocate(3)
    assert a is not None and len(a) == 3
    assert bm.allocate(2) is None
    assert bm.num_available() == 1
    bm.release(a)
    assert bm.num_available() == 4
    bm.check()


def test_cached_blocks_survive_release_and_evict_lru_first():
    events = []
    bm = BlockManager(3, lambda: lambda kind, hs: events.append((kind, hs)))
    a = bm.allocate(3)
    bm.register(a, [h(1), h(2), h(3)])
    assert events == [("stored", [h(1), h(2), h(3)])]
    bm.release(a)  # reversed: h(3) becomes the least recently used
    assert bm.cached_prefix([h(1), h(2), h(3), h(4)]) == 3
    got = bm.allocate(1)
    assert got == [a[2]] and events[-1] == ("removed", [h(3)])
    assert bm.cached_prefix([h(1), h(2), h(3)]) == 2
    bm.check()


def test_acquire_pins_against_eviction():
    bm = BlockManager(2)
    a = bm.allocate(2)
    bm.register(a, [h(1), h(2)])
    bm.release(a)
    pinned = bm.acquire([h(1)])
    assert bm.allocate(2) is None
    assert bm.allocate(1) == [a[1]]
    assert bm.cached[h(1)] == pinned[0]
    bm.check()


def test_duplicate_hash_stays_unkeyed_and_returns_to_free():
    bm = BlockManager(2)
    a, b = bm.allocate(1), bm.allocate(1)
    assert bm.register(a, [h(7)]) == 1
    assert bm.register(b, [h(7)]) == 0
    bm.release(b)
    assert list(bm.free) == b
    bm.check()


def test_forget_frees_unreferenced_cached_blocks_only():
    events = []
    bm = BlockManager(3, lambda: lambda kind, hs: events.append((kind, hs)))
    a = bm.allocate(3)
    bm.register(a, [h(1), h(2), h(3)])
    bm.release(a[:2])  # h(3) stays referenced
    assert bm.forget([h(1), h(3), h(9)]) == 1
    assert events[-1] == ("removed", [h(1)])
    assert bm.cached_prefix([h(1)]) == 0 and bm.cached[h(2)] == a[1] and bm.cached[h(3)] == a[2]
    assert len(bm.free) == 1 and list(bm.lru) == [a[1]]
    assert bm.forget([h(1)]) == 0 and len(events) == 2  # nothing removed: no event
    bm.check()


def test_a_flex_scan_evicts_flex_blocks_before_an_interactive_prefix():
    bm = BlockManager(6)
    chat = bm.allocate(2)  # a system prompt, cached by an interactive request
    bm.register(chat, [h(1), h(2)])
    bm.release(chat)
    shared = bm.allocate(1, flex=True)  # a flex request's block that an interactive one then reuses
    bm.register(shared, [h(9)])
    bm.release(shared)
    assert bm.acquire([h(9)], flex=False) == shared
    bm.release(shared)
    for i in range(10):  # a flex scan of unique prompts, older than none of the chat blocks
        got = bm.allocate(3, flex=True)
        bm.register(got, [h(100 + 3 * i + j) for j in range(3)])
        bm.release(got)
        bm.check()
        assert bm.cached_prefix([h(1), h(2)]) == 2 and bm.cached_prefix([h(9)]) == 1
    assert bm.evicted["other"] == 0 and bm.evicted["flex"] == 27 and len(bm.flex_lru) == 3
    # with no flex block left to evict, the least recently used other block goes
    got = bm.allocate(6)
    assert got is not None and bm.evicted == {"flex": 30, "other": 3, "session": 0}
    bm.release(got)
    bm.check()


def test_a_flex_request_taking_a_cached_interactive_block_leaves_it_protected():
    bm = BlockManager(2)
    a = bm.allocate(1)
    bm.register(a, [h(1)])
    bm.release(a)
    assert bm.acquire([h(1)], flex=True) == a
    bm.release(a)
    assert list(bm.lru) == a and not bm.flex_lru


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "register", "release", "acquire", "forget"]),
                          st.integers(0, 5), st.integers(0, 9), st.booleans()), max_size=60))
def test_accounting_invariant_random_ops(ops):
    """With sessions of two tenants (quota 2 each) keeping blocks for 0, 10 or 20 ops."""
    clock = [0.0]
    bm = BlockManager(6, clock=lambda: clock[0], session_blocks_per_key=2)
    owned: list[list[int]] = []  # each entry: blocks one holder references
    for op, n, k, flex in ops:
        clock[0] += 1
        if op == "alloc":
            got = bm.allocate(n, flex)
            if got is None:
                assert n > bm.num_available()
            else:
                owned.append(got)
        elif op == "register" and owned:
            blocks = owned[k % len(owned)]
            bm.register(blocks, [h(k * 10 + i) for i in range(len(blocks))])
        elif op == "release" and owned:
            bm.release(owned.pop(k % len(owned)), keep_s=10.0 * (n % 3), tenant="ab"[k % 2])
        elif op == "acquire":
            hs = [h(k * 10 + i) for i in range(n)]
            m = bm.cached_prefix(hs)
            owned.append(bm.acquire(hs[:m], flex))
        elif op == "forget":
            bm.forget([h(k * 10 + i) for i in range(n)])
        bm.check()
        refs = sum(len(o) for o in owned)
        assert sum(bm.ref) == refs
    for o in owned:
        bm.release(o)
    bm.check()
    assert bm.num_available() == bm.num_blocks
