"""The KV index's runs: each holder's run from block 0, the stores' coverage taking turns, and
the index following every add, remove and node removal (checked against a plain model of who
holds what)."""

from __future__ import annotations

import random

from mooncake.sched.kv_index import KVIndex

CHAIN = [bytes([i, 7]) * 16 for i in range(40)]


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
        if op < 0.55:
            idx.add(node, "t", blocks)
            model.setdefault(node, set()).update(blocks)
        elif op < 0.9:
            idx.remove(node, blocks)
            model.get(node, set()).difference_update(blocks)
        else:
            assert idx.drop_node(node) == len(model.pop(node, ()))
        for n in nodes:
            assert idx.blocks_of(n) == len(model.get(n, ()))
        assert len(idx) == len(set().union(*model.values())) if model else len(idx) == 0
        for start in (0, 3, 17):
            chain = CHAIN[start:]
            assert idx.prefix_runs(chain, stores) == reference_runs(model, chain, stores), step
