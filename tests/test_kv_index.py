"""The KV index's runs: each holder's run from block 0, the stores' coverage taking turns, and
the index following every add, remove and node removal (checked against a plain model of who
holds what). Every test runs on both walks: the C fingerprint table and the Python sets."""

from __future__ import annotations

import random
import shutil

import pytest

from mooncake.sched.fingerprint_table import FingerprintTable
from mooncake.sched.kv_index import KVIndex

CHAIN = [bytes([i, 7]) * 16 for i in range(40)]


@pytest.fixture(autouse=True, params=["c_table", "python_sets"])
def walk(request, monkeypatch):
    """``KVIndex()`` in this module is the index with that walk."""
    native = request.param == "c_table"
    if native and FingerprintTable.create() is None:
        pytest.skip("no C compiler: the fingerprint table cannot be built")
    monkeypatch.setitem(globals(), "KVIndex", lambda: _KVIndex(native=native))
    return request.param


_KVIndex = KVIndex


def reference_runs(held: dict[str, set[bytes]], chain: list[bytes], stores: set[str]) -> tuple[dict[str, int], int]:
    """Runs and store coverage by a block-by-block walk over a plain node -> blocks model."""
    runs = {}
    for node, blocks in held.items():
        n = 0
        while n < len(chain) and chain[n] in blocks:
            n += 1
        if n:
            runs[node] = n
    store_end = 0
    while store_end < len(chain) and any(chain[store_end] in held[s] for s in stores if s in held):
        # the stores take turns: each turn, the longest run of a store holding the block
        store_end += max(next((k for k, h in enumerate(chain[store_end:]) if h not in held[s]), len(chain) - store_end)
                         for s in stores if s in held and chain[store_end] in held[s])
    return runs, store_end


def apply_event(idx: KVIndex, model: dict[str, set[bytes]], node: str, blocks: list[bytes], op: str) -> None:
    """One event on the index and on the plain model alike."""
    if op == "add":
        idx.add(node, "t", blocks)
        model.setdefault(node, set()).update(blocks)
    elif op == "remove":
        idx.remove(node, blocks)
        model.get(node, set()).difference_update(blocks)
    else:
        assert idx.drop_node(node) == len(model.pop(node, ()))


def test_runs_end_where_each_holder_stops_and_at_gaps():
    idx = KVIndex()
    idx.add("p0", "device", CHAIN[:10])
    idx.add("p1", "device", CHAIN[:3] + CHAIN[4:30])  # a gap at block 3: its run is 3, whatever it holds after
    idx.add("p2", "device", CHAIN[5:20])  # no block 0: no run
    idx.add("s0", "dram", CHAIN[:25])
    runs, store_end = idx.prefix_runs(CHAIN, {"s0"})
    assert runs == {"p0": 10, "p1": 3, "s0": 25} and store_end == 25
    assert idx.prefix_runs(CHAIN[:7], {"s0"}) == ({"p0": 7, "p1": 3, "s0": 7}, 7)


def test_stores_take_turns_and_covering_runs_follow_them():
    idx = KVIndex()
    idx.add("s0", "dram", CHAIN[:8])
    idx.add("s1", "ssd", CHAIN[5:20])
    idx.add("s2", "dram", CHAIN[18:33])
    idx.add("p0", "device", CHAIN[:4])
    runs, store_end = idx.prefix_runs(CHAIN, {"s0", "s1", "s2"})
    assert runs == {"s0": 8, "p0": 4} and store_end == 33  # s0 to 8, s1 to 20, s2 to 33
    assert idx.covering_run(CHAIN[:store_end], 4, {"s0", "s1", "s2"}, (), runs) == \
        [(4, 8, "s0"), (8, 20, "s1"), (20, 33, "s2")]
    assert idx.covering_run(CHAIN[:store_end], 4, {"s0", "s1", "s2"}, ("s1",), runs) == \
        [(4, 8, "s0"), (8, 20, "s1"), (20, 33, "s2")]  # s1 does not hold block 4: s0 first
    assert idx.prefix_runs(CHAIN, {"s1"}) == ({"s0": 8, "p0": 4}, 0)  # s1 has no block 0


def test_removed_blocks_and_dropped_nodes_leave_nothing_behind():
    idx = KVIndex()
    idx.add("a", "device", CHAIN[:6])
    idx.add("b", "dram", CHAIN[:6])
    idx.remove("a", [CHAIN[2]])
    assert idx.prefix_runs(CHAIN, {"b"}) == ({"a": 2, "b": 6}, 6)
    assert idx.holders(CHAIN[2]) == {"b": "dram"}
    assert idx.drop_node("b") == 6
    assert idx.prefix_runs(CHAIN, {"b"}) == ({"a": 2}, 0)
    assert idx.holders(CHAIN[2]) == {} and len(idx) == 5
    idx.add("c", "dram", CHAIN[:4])  # a node joining after b left must not inherit b's blocks
    assert idx.prefix_runs(CHAIN, {"c"}) == ({"a": 2, "c": 4}, 4)
    idx.remove("a", CHAIN[:6])
    idx.remove("c", CHAIN[:4])
    assert len(idx) == 0 and idx.prefix_runs(CHAIN, {"c"}) == ({}, 0)
    idx.remove("nobody", CHAIN[:3])  # a node the index never saw: nothing happens
    assert idx.drop_node("nobody") == 0


def test_holder_order_and_tiers_are_kept():
    idx = KVIndex()
    idx.add("s1", "ssd", CHAIN[:2])
    idx.add("s0", "dram", CHAIN[:2])
    idx.add("s1", "dram", CHAIN[:1])  # moved up a tier: same place in the order
    assert list(idx.holders(CHAIN[0]).items()) == [("s1", "dram"), ("s0", "dram")]
    assert idx.covering_run(CHAIN[:2], 0, {"s0", "s1"}) == [(0, 2, "s1")]


def test_random_events_agree_with_a_plain_model():
    """Adds, removes and node removals in any order: every walk agrees with the plain model."""
    rng = random.Random(3)
    nodes = [f"n{i}" for i in range(12)]
    stores = {"n0", "n1", "n2", "n3"}
    idx, model = KVIndex(), {}
    for step in range(600):
        node = rng.choice(nodes)
        op = rng.random()
        lo = rng.choice([0, rng.randrange(len(CHAIN))])
        blocks = [h for h in CHAIN[lo:rng.randrange(lo, len(CHAIN) + 1)] if rng.random() < 0.9]
        apply_event(idx, model, node, blocks, "add" if op < 0.55 else "remove" if op < 0.9 else "drop")
        for n in nodes:
            assert idx.blocks_of(n) == len(model.get(n, ()))
        assert len(idx) == len(set().union(*model.values())) if model else len(idx) == 0
        for start in (0, 3, 17):
            chain = CHAIN[start:]
            assert idx.prefix_runs(chain, stores) == reference_runs(model, chain, stores), step


def test_the_c_table_is_used_where_a_compiler_is(walk):
    if shutil.which("cc") or shutil.which("gcc"):
        assert KVIndex().native == (walk == "c_table")


def test_many_nodes_many_blocks_and_reused_bits_agree_with_a_plain_model():
    """More than 64 nodes (masks wider than a word), thousands of blocks (the table grows, and
    deletions shift probe runs back), nodes dropped and their bits reused by new ones."""
    rng = random.Random(11)
    chain = [rng.randbytes(32) for _ in range(3000)]
    nodes = [f"n{i}" for i in range(150)]
    stores = set(nodes[::7])
    idx, model = KVIndex(), {}
    for step in range(400):
        node = rng.choice(nodes)
        lo = rng.randrange(0, len(chain), 50)
        blocks = chain[lo:lo + rng.randrange(1, 400)]
        op = rng.random()
        apply_event(idx, model, node, blocks, "add" if op < 0.6 else "remove" if op < 0.9 else "drop")
        if step % 20 == 0:
            assert len(idx) == len(set().union(*model.values())) if model else len(idx) == 0
            for start in (0, 50, 1000, 2950):
                sub = chain[start:start + 300]
                assert idx.prefix_runs(sub, stores) == reference_runs(model, sub, stores), step


def test_a_table_past_a_huge_page_starts_empty_and_keeps_every_block():
    """Past 2 MB the table's slots are allocated apart (aligned, advised onto huge pages):
    growing through that size, removing and dropping a node there, nothing is lost or left."""
    rng = random.Random(5)
    chains = [[rng.randbytes(32) for _ in range(100)] for _ in range(1500)]  # 150,000 blocks
    idx = KVIndex()
    for i, chain in enumerate(chains):
        idx.add(f"n{i % 3}", "device", chain[: 50 + i % 50])
        idx.add("s", "dram", chain)
    assert len(idx) == 150_000
    for i in range(0, 1500, 97):
        assert idx.prefix_runs(chains[i], {"s"}) == ({f"n{i % 3}": 50 + i % 50, "s": 100}, 100)
    assert idx.prefix_runs([rng.randbytes(32)], {"s"}) == ({}, 0)
    for chain in chains[::2]:
        idx.remove("s", chain)
    assert idx.drop_node("n0") > 0
    assert idx.prefix_runs(chains[0], {"s"}) == ({}, 0)
    assert idx.prefix_runs(chains[1], {"s"}) == ({"n1": 51, "s": 100}, 100)
    assert idx.prefix_runs(chains[2], {"s"}) == ({"n2": 52}, 0)


def test_hashes_of_any_length_are_indexed():
    """Fingerprints are a hash's first 8 bytes: shorter hashes and chains of mixed lengths still
    walk right (only the conductor's own chains, of one scheme, take the fast path)."""
    short = [bytes([i]) for i in range(5)]
    mixed = [bytes([i, 3]) * 8 if i % 2 else bytes([i, 3]) * 16 for i in range(6)]
    idx = KVIndex()
    idx.add("a", "device", short[:4])
    idx.add("b", "dram", mixed[:5])
    idx.add("b", "dram", short[:2])
    assert idx.prefix_runs(short, {"b"}) == ({"a": 4, "b": 2}, 2)
    assert idx.prefix_runs(mixed, {"b"}) == ({"b": 5}, 5)
    idx.remove("b", mixed[2:3])
    assert idx.prefix_runs(mixed, {"b"}) == ({"b": 2}, 2)


def test_fingerprint_table_deletes_inside_probe_runs(walk):
    """Blocks whose fingerprints share a home slot (and wrap around the table's end) stay
    findable whichever of them leaves first."""
    if walk != "c_table":
        pytest.skip("the C table only")
    table = FingerprintTable.create()

    def fp(v: int) -> bytes:
        return v.to_bytes(8, "little") + b"tail"

    same_home = [fp(1023 + k * 1024) for k in range(6)]  # home: the last slot of 1,024; the run wraps
    neighbours = [fp(k) for k in range(1, 4)]  # homes inside the wrapped run
    held = {0: set(same_home + neighbours), 1: set(same_home[::2])}
    table.add(0, same_home + neighbours)
    table.add(1, same_home[::2])

    def check() -> None:
        for h in same_home + neighbours:
            pairs, store_end = table.walk([h], 0)
            assert (list(pairs), store_end) == ([x for b in (0, 1) if h in held[b] for x in (b, 1)], 0)
        assert len(table) == len(held[0] | held[1])

    check()
    for gone in (same_home[1], same_home[0], neighbours[0], same_home[5], neighbours[2]):
        table.remove(0, [gone])
        held[0].discard(gone)
        check()
    table.clear_bit(1)
    held[1].clear()
    check()
