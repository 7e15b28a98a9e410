"""Full garbage collections stop every thread of a role process (the GIL): what they walk is
kept small — start-up's objects are frozen before serving, and the conductor's KV index holds
no object the collector tracks per block."""

from __future__ import annotations

import gc

from mooncake import cli
from mooncake.sched.kv_index import KVIndex


def test_serve_freezes_what_start_up_made(monkeypatch):
    seen = []

    def run(coro):
        seen.append(gc.get_freeze_count())
        coro.close()

    monkeypatch.setattr(cli.uvloop, "run", run)
    monkeypatch.setattr(cli, "setup_logging", lambda level: None)  # this process's logging stays pytest's
    gc.unfreeze()
    try:
        assert cli.main(["serve", "--role", "conductor"]) == 0
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 1000  # the modules imported so far, at least


def tracked_containers(obj: object, depth: int = 3) -> list[int]:
    """The sizes of the containers reachable from ``obj`` (``depth`` references deep) that the
    collector tracks: a full collection walks each of their entries."""
    sizes, seen, level = [], set(), [obj]
    for _ in range(depth):
        nxt = []
        for o in level:
            for r in gc.get_referents(o):
                if id(r) not in seen and isinstance(r, (dict, list, set, tuple)):
                    seen.add(id(r))
                    if gc.is_tracked(r):
                        sizes.append(len(r))
                    nxt.append(r)
        level = nxt
    return sizes


def test_the_kv_index_tracks_no_container_of_its_blocks():
    for native in (True, False):
        idx = KVIndex(native=native)
        chains = {node: [bytes([n, i % 256, i // 256]) * 11 for i in range(5000)] for n, node in enumerate("abcd")}
        for node, chain in chains.items():
            idx.add(node, "device", chain)
            idx.add("store", "dram", chain)
        for node, chain in chains.items():
            idx.remove(node, chain[::2])
        idx.drop_node("a")
        assert len(idx) == 20_000 and idx.holders(chains["b"][1]) == {"b": "device", "store": "dram"}
        assert max(tracked_containers(idx)) < 10  # a node's dict, its bit: never a block's
