"""The store's disk side: write-through copies, persist on shutdown, one store per directory,
and LMDB faults (corrupt environment, full map, full disk), in-process and in real processes."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mooncake.config import load_config
from mooncake.kv.integrity import checksums
from mooncake.testing.store_process import start_store_process
from mooncake.testing.wait import wait_for
from mooncake.tiers.client import StoreClient
from mooncake.tiers.dir_lock import DirLocked
from mooncake.tiers.memory import DramTier
from mooncake.tiers.lmdb_tier import LmdbTier
from mooncake.tiers.tiered import TieredStore

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 64 * 1024  # bytes of one test block
MiB = 1 << 20


def put(store: TieredStore, k: bytes, block: torch.Tensor) -> bool:
    return store.put_many([k], [block]) == 1


def blk(v: float) -> torch.Tensor:
    return torch.full((BLOCK // 4,), float(v))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def store(path: Path, dram: int = 4, disk: int = 64, mode: str = "on_demotion", **lmdb_kw) -> TieredStore:
    return TieredStore([DramTier(dram * BLOCK), LmdbTier(path, disk * BLOCK, **lmdb_kw)], ssd_admission=mode)


def test_persist_moves_memory_blocks_to_disk_most_recent_kept(tmp_path):
    s = store(tmp_path, dram=4, disk=5)
    for i in range(6):  # 2 on disk, 4 in DRAM
        put(s, key(i), blk(i))
    s.get_many([key(2)])  # most recently used
    assert s.persist(deadline=float("inf")) == (4, 0)
    s.check_invariants()
    s.close()
    s = store(tmp_path, dram=4, disk=5)  # disk holds 5: the least recently used one is gone
    assert {k for k, _ in s.stored()} == {key(i) for i in (1, 2, 3, 4, 5)}
    assert all(torch.equal(b.tensor, blk(int.from_bytes(k[:4], "big"))) for k, b in s.get_many(map(key, range(6))))
    s.close()


def test_the_checksums_blocks_were_put_with_survive_demotion_and_a_restart(tmp_path):
    """The end-to-end check holds after a restart: a block read back from LMDB carries the checksum
    its writer sent (a reader verifies it), not 0 (unchecked)."""
    from mooncake.kv.integrity import checksums

    s = store(tmp_path, dram=2, disk=8)
    blocks = [blk(i) for i in range(4)]
    sums = checksums(blocks)
    s.put_many([key(i) for i in range(4)], blocks, "m", sums)  # two are demoted to disk at once
    s.put_many([key(9)], [blk(9)])  # sent without one: 0, not checked
    assert [b.checksum for _, b in s.get_many([key(i) for i in range(4)])] == sums
    s.persist(deadline=float("inf"))
    s.close()
    s = store(tmp_path, dram=2, disk=8)
    found = dict(s.get_many([key(i) for i in (0, 1, 2, 3, 9)]))
    assert [found[key(i)].checksum for i in range(4)] == sums and found[key(9)].checksum == 0
    s.close()


def test_persist_stops_at_its_deadline(tmp_path):
    s = store(tmp_path)
    s.put_many([key(i) for i in range(4)], [blk(i) for i in range(4)])
    assert s.persist(deadline=0.0) == (0, 4)
    s.close()


def test_write_through_copies_adopted_on_demotion_dropped_on_removal(tmp_path):
    s = store(tmp_path, dram=2, disk=8, mode="write_through")
    s.put_many([key(0), key(1)], [blk(0), blk(1)])
    assert s.writer.wait_idle(10)
    disk = s.tiers[1]
    assert disk.has_copy(key(0)) and disk.has_copy(key(1)) and disk.used_bytes == 2 * BLOCK
    s.check_invariants()
    put(s, key(2), blk(2))  # key 0 demoted: its copy becomes the block, nothing written again
    assert s.tier_of(key(0)) == "lmdb" and not disk.has_copy(key(0))
    assert s.remove([key(1)]) == 1 and not disk.has_copy(key(1))
    s.get_many([key(0)])  # promoted: the record stays as the copy
    assert s.tier_of(key(0)) == "dram" and disk.has_copy(key(0))
    assert s.writer.wait_idle(10)
    s.check_invariants()
    assert s.snapshot()["write_through"]["written"] == 3
    s.writer.close()
    s.tiers[1].env.close()  # as if the process died: no persist, no flush, no sync
    s.tiers[1].lock.release()
    survivor = LmdbTier(tmp_path, 8 * BLOCK)
    assert set(survivor.keys()) == {key(0), key(2)}
    assert torch.equal(survivor.get(key(2)).tensor, blk(2))
    survivor.close()


def test_write_through_under_concurrent_puts_removes_and_reads(tmp_path):
    """The writer writes without the store's lock while other threads put, demote, promote and
    remove: afterwards the accounting holds and every block on disk is the one put under its key."""
    s = store(tmp_path, dram=6, disk=40, mode="write_through")

    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(60):
                k = t * 1000 + i + 1
                put(s, key(k), blk(k))
                if i % 3 == 0:
                    s.remove([key(k - 1)])
                if i % 4 == 0:
                    s.get_many([key(t * 1000 + i // 2 + 1)])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert s.writer.wait_idle(30)
    s.check_invariants()
    assert s.persist(float("inf"))[1] == 0
    s.close()
    disk = LmdbTier(tmp_path, 40 * BLOCK)
    assert len(disk) > 20
    for k in disk.keys():
        assert torch.equal(disk.get(k).tensor, blk(int.from_bytes(k[:4], "big")))
    disk.close()


def test_write_through_queue_is_bounded_and_counts_what_it_drops():
    from mooncake.tiers.write_through import WriteThrough

    gate, written = threading.Event(), []

    def slow_disk(keys: list[bytes]) -> int:
        gate.wait(10)
        written.extend(keys)
        return len(keys)

    w = WriteThrough(slow_disk, batch_blocks=2, max_queued=4)
    w.submit([b"a", b"b"])  # taken by the writer, which waits on the disk
    wait_for(lambda: w.queued == 0, 5, "the first batch taken")
    w.submit([b"c", b"d", b"e", b"f", b"g", b"h"])  # 4 fit behind it, 2 do not
    assert w.queued == 4 and w.dropped == 2
    gate.set()
    assert w.wait_idle(10)
    assert written == [b"a", b"b", b"c", b"d", b"e", b"f"] and w.dropped == 2
    w.close(5)


def test_one_store_per_directory(tmp_path):
    first = LmdbTier(tmp_path / "node0-store", MiB)
    with pytest.raises(DirLocked, match=r"locked by another store \(pid \d+\).*node_id"):
        LmdbTier(tmp_path / "node0-store", MiB)
    other = LmdbTier(tmp_path / "node1-store", MiB)  # one data_dir, two stores
    other.close()
    first.close()
    LmdbTier(tmp_path / "node0-store", MiB).close()  # released on close


def test_corrupt_environment_moved_aside_store_starts_empty(tmp_path, caplog):
    s = store(tmp_path)
    s.put_many([key(i) for i in range(8)], [blk(i) for i in range(8)])
    s.persist(float("inf"))
    s.close()
    data = tmp_path / "data.mdb"
    data.write_bytes(os.urandom(data.stat().st_size))
    s = store(tmp_path)
    assert s.stored() == []
    aside = s.tiers[1].moved_aside
    assert aside is not None and aside.exists() and aside.name.startswith("data.mdb.corrupt-")
    assert "corrupt" in caplog.text and str(aside) in caplog.text
    assert put(s, key(1), blk(1)) and s.persist(float("inf")) == (1, 0)  # a working store again
    s.close()
    assert set(LmdbTier(tmp_path, MiB).keys()) == {key(1)}


def test_full_map_evicts_and_keeps_the_newest(tmp_path):
    s = TieredStore([DramTier(BLOCK), LmdbTier(tmp_path, 1000 * BLOCK, map_bytes=2 * MiB)])
    for i in range(60):  # far more than 2 MiB of records
        put(s, key(i), blk(i))
    disk = s.tiers[1]
    assert disk.map_full >= 1 and disk.capacity_bytes < 1000 * BLOCK
    assert s.tier_of(key(59)) == "dram" and s.tier_of(key(58)) == "lmdb" and s.tier_of(key(0)) is None
    assert torch.equal(s.get_many([key(58)])[0][1].tensor, blk(58))
    s.check_invariants()
    s.close()


def test_full_disk_fails_soft_and_serving_goes_on(tmp_path, caplog):
    s = store(tmp_path, dram=2, disk=64)
    put(s, key(0), blk(0))
    size = (tmp_path / "data.mdb").stat().st_size
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, old_limit[1]))  # no file may grow: a full disk
    try:
        for i in range(1, 8):
            assert put(s, key(i), blk(i))  # DRAM takes it; the demoted blocks fail to reach the disk
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    snap = s.snapshot()
    assert snap["disk_write_errors"] >= 1 and "LMDB write" in caplog.text
    assert [k for k, _ in s.get_many([key(6), key(7)])] == [key(6), key(7)]  # still serving
    s.check_invariants()
    assert put(s, key(9), blk(9)) and s.persist(float("inf"))[1] == 0  # the disk has room again
    s.close()


# ---------------------------------------------------------------- real processes


def _server(data_dir: Path, *args: str) -> tuple[subprocess.Popen, str]:
    return start_store_process(data_dir, *args)


async def test_write_through_survives_sigkill(tmp_path):
    args = ("--dram-bytes", str(64 * MiB), "--lmdb-bytes", str(64 * MiB), "--ssd-admission", "write_through")
    hs = [key(i) for i in range(12)]
    blocks = torch.randn(12, BLOCK // 4)
    proc, ep = _server(tmp_path, *args)
    try:
        c = StoreClient(ep)
        assert await c.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 12  # all in DRAM
        for _ in range(200):
            wt = (await c.stats())["write_through"]
            if wt["written"] == 12 and wt["queued"] == 0:
                break
            await __import__("asyncio").sleep(0.05)
        assert wt["written"] == 12
        c.close()
    finally:
        proc.kill()  # SIGKILL: no persist, no close
        proc.wait()
    proc, ep = _server(tmp_path, *args)
    try:
        c = StoreClient(ep)
        got_h, got = await c.get(hs, prefix=True)
        assert got_h == hs and all(torch.equal(a, b) for a, b in zip(got, blocks))
        c.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_second_store_role_with_the_same_id_fails_clearly(tmp_path):
    """Store roles (mooncake serve --role store) on one data_dir: the same node id twice is refused
    at start, exit non-zero; a different id starts (each waits for a conductor that never comes)."""
    cfg = tmp_path / "store.toml"
    cfg.write_text(f'[store]\ndata_dir = "{tmp_path / "data"}"\ndram_bytes = 1048576\nlmdb_bytes = 1048576\n'
                   f'[conductor]\nendpoint = "ipc://{tmp_path}/nobody"\n')
    assert load_config(cfg).store.data_dir

    def role(node_id: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "mooncake.cli", "serve", "--role", "store", "--config",
                                 str(cfg)], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "MOONCAKE_NODE_NODE_ID": node_id})

    def holds_lock(node_id: str) -> bool:
        lock = tmp_path / "data" / node_id / "LOCK"
        return lock.exists() and lock.read_text().strip().isdigit()

    first, other = role("a-store"), role("b-store")
    try:
        wait_for(lambda: holds_lock("a-store") and holds_lock("b-store"), 60, "both stores to lock their dirs")
        second = role("a-store")
        _, err = second.communicate(timeout=60)
        assert second.returncode != 0
        assert "a-store" in err and "locked by another store" in err and f"pid {first.pid}" in err
        assert first.poll() is None and other.poll() is None
    finally:
        for p in (first, other):
            p.kill()
            p.wait()
