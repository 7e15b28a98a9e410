"""P2P objects, in process: manifests, chunks on disk (verify, resume, corruption, full
disk), records, and the conductor's index of holders."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import xxhash

from mooncake.p2p.index import P2PIndex
from mooncake.p2p.manifest import ObjectError, build_manifest, check_name, spans, validate
from mooncake.protocol.p2p import (Done, Failure, Fetching, FindStore, Forget, Have, ListObjects, Listing, Locate, Located,
                                   Publish, RemoveObject, StoreAt, bits)
from mooncake.p2p.objects import ChunkCorrupt, DiskFull, LocalObject, NotHeld, ObjectStore
from mooncake.protocol import NodeInfo
from mooncake.sched.node_registry import Cluster, Node

CHUNK = 64 * 1024


def make_tree(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "weights.bin").write_bytes(os.urandom(5 * CHUNK + 123))
    (root / "sub" / "config.json").write_text('{"a": 1}')
    (root / "sub" / "deeper" / "empty").write_bytes(b"")
    return root


def test_manifest_covers_every_file_in_chunks(tmp_path):
    src = make_tree(tmp_path / "src")
    root, m = build_manifest("model:v1", src, CHUNK)
    assert root == src.resolve()
    assert [f.path for f in m.files] == ["sub/config.json", "sub/deeper/empty", "weights.bin"]
    assert m.files[2].sha256 == hashlib.sha256((src / "weights.bin").read_bytes()).hexdigest()
    assert len(m.checksums) == len(spans(m)) == 1 + 0 + 6  # a partial last chunk, an empty file: none
    assert validate(m) is m
    _, again = build_manifest("model:v1", src, CHUNK)
    assert again.version == m.version  # content-addressed
    (src / "sub" / "config.json").write_text('{"a": 2}')
    assert build_manifest("model:v1", src, CHUNK)[1].version != m.version


def test_bad_names_and_manifests_are_refused(tmp_path):
    for bad in ("", "../x", "a/b", "-x", "x" * 300):
        with pytest.raises(ObjectError, match="invalid object name"):
            check_name(bad)
    with pytest.raises(ObjectError, match="no such file"):
        build_manifest("x", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ObjectError, match="no files"):
        build_manifest("x", tmp_path / "empty")
    _, m = build_manifest("x", make_tree(tmp_path / "src"), CHUNK)
    evil = msgspec.structs.replace(m, files=[msgspec.structs.replace(m.files[0], path="../../etc/passwd"), *m.files[1:]])
    with pytest.raises(ObjectError, match="unsafe file path"):
        validate(evil)
    with pytest.raises(ObjectError, match="version does not match"):
        validate(msgspec.structs.replace(m, checksums=[c ^ 1 for c in m.checksums]))
    forged = [bytes([d[0] ^ 1]) + d[1:] for d in m.digests]
    with pytest.raises(ObjectError, match="version does not match"):  # the chunk digests are part of the version
        validate(msgspec.structs.replace(m, digests=forged))
    with pytest.raises(ObjectError, match="BLAKE3 digests for 7 chunks"):
        validate(msgspec.structs.replace(m, digests=m.digests[:-1]))


def test_chunks_verify_on_write_and_files_on_completion(tmp_path):
    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    src = LocalObject(m, src_root, set(range(len(m.checksums))))
    dst = LocalObject(m, tmp_path / "dst")
    dst.prepare()
    assert dst.done == set() and (tmp_path / "dst" / "sub" / "deeper" / "empty").exists()
    data = src.read_chunk(3)
    assert not dst.write_chunk(3, data[:-1])  # short: refused
    assert not dst.write_chunk(3, bytes([data[0] ^ 1]) + data[1:])  # corrupt: not to be counted
    for i in range(len(m.checksums)):
        assert dst.write_chunk(i, memoryview(src.read_chunk(i)))
    dst.verify_files()
    for f in m.files:
        assert (tmp_path / "dst" / f.path).read_bytes() == (src_root / f.path).read_bytes()
    src.close()
    dst.close()


def test_close_waits_for_io_under_way_and_refuses_later_io(tmp_path):
    """``mooncake p2p rm`` closes an object while a thread may be reading or writing it: a
    descriptor closed under that call could be reused by another file before the call lands."""
    import threading

    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    src = LocalObject(m, src_root, set(range(len(m.checksums))))
    entered, release = threading.Event(), threading.Event()
    real_pread = os.pread

    def slow_pread(fd: int, n: int, off: int) -> bytes:
        entered.set()
        release.wait(10)
        return real_pread(fd, n, off)

    got: list = []
    os.pread = slow_pread
    try:
        reader = threading.Thread(target=lambda: got.append(src.read_chunk(0)))
        reader.start()
        assert entered.wait(10)
        closer = threading.Thread(target=src.close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive()  # waits for the read under way
        release.set()
        reader.join(10)
        closer.join(10)
    finally:
        os.pread = real_pread
    assert not closer.is_alive() and got and len(got[0]) == src.spans[0].length
    with pytest.raises(NotHeld):
        src.read_chunk(1)


def with_fast_checksum_of(m, index: int, data: bytes):
    """``m`` as a holder would see it if chunk ``index`` were ``data``: its xxh3 matches ``data``
    (a forged chunk that passes the fast check), its BLAKE3 digest still the published chunk's."""
    sums = list(m.checksums)
    sums[index] = xxhash.xxh3_64_intdigest(data)
    return msgspec.structs.replace(m, checksums=sums)


def test_a_chunk_counts_only_if_it_matches_its_digest(tmp_path, monkeypatch):
    """A chunk is hashed as it is written (slice by slice): a forged one is refused, its good copy
    overwrites it, and a fetch resumed before that does not count it."""
    monkeypatch.setattr("mooncake.p2p.objects.WRITE_SLICE", 4096)  # several slices per chunk
    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    src = LocalObject(m, src_root, set(range(len(m.checksums))))
    good = src.read_chunk(4)
    forged = good[:-1] + bytes([good[-1] ^ 1])  # the last slice differs
    dst = LocalObject(with_fast_checksum_of(m, 4, forged), tmp_path / "dst")
    dst.prepare()
    assert not dst.write_chunk(4, forged)  # passes the xxh3, not the BLAKE3: refused
    dst.close()
    resumed = LocalObject(m, tmp_path / "dst")
    resumed.prepare()
    assert 4 not in resumed.done  # the forged bytes on disk do not count
    assert resumed.write_chunk(4, memoryview(good))
    span = resumed.spans[4]
    with open(tmp_path / "dst" / "weights.bin", "rb") as f:
        f.seek(span.offset)
        assert f.read(span.length) == good  # overwritten by the good copy
    src.close()
    resumed.close()


def test_a_file_that_changes_size_before_the_fetch_ends_is_an_error(tmp_path):
    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    src = LocalObject(m, src_root, set(range(len(m.checksums))))
    dst = LocalObject(m, tmp_path / "dst")
    dst.prepare()
    for i in range(len(m.checksums)):
        assert dst.write_chunk(i, src.read_chunk(i))
    dst.verify_files()  # every chunk matched its digest: the files are complete, no re-reading
    with open(tmp_path / "dst" / "weights.bin", "ab") as f:
        f.write(b"appended")
    with pytest.raises(ObjectError, match=r"weights.bin is \d+ bytes after the fetch"):
        dst.verify_files()
    src.close()
    dst.close()


def test_a_resumed_fetch_keeps_only_chunks_matching_their_digests(tmp_path):
    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    src = LocalObject(m, src_root, set(range(len(m.checksums))))
    first = LocalObject(m, tmp_path / "dst")
    first.prepare()
    for i in range(len(m.checksums)):
        first.write_chunk(i, src.read_chunk(i))
    first.close()  # interrupted (say), and then the weights' third chunk changes on disk
    w = tmp_path / "dst" / "weights.bin"
    raw = bytearray(w.read_bytes())
    tampered = bytes(CHUNK)
    raw[2 * CHUNK: 3 * CHUNK] = tampered
    w.write_bytes(bytes(raw))
    forged = [s.index for s in first.spans if m.files[s.file].path == "weights.bin"][2]
    again = LocalObject(with_fast_checksum_of(m, forged, tampered), tmp_path / "dst")
    again.prepare()
    assert again.done == set(range(len(m.checksums))) - {forged}  # its xxh3 matches, its BLAKE3 does not
    assert again.write_chunk(forged, src.read_chunk(forged))
    again.verify_files()
    assert w.read_bytes() == (src_root / "weights.bin").read_bytes()
    again.close()
    src.close()


def test_a_fetch_resumes_from_the_chunks_on_disk(tmp_path):
    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    src = LocalObject(m, src_root, set(range(len(m.checksums))))
    first = LocalObject(m, tmp_path / "dst")
    first.prepare()
    for i in (0, 2, 4):
        first.write_chunk(i, src.read_chunk(i))
    first.close()  # interrupted
    again = LocalObject(m, tmp_path / "dst")
    again.prepare()
    assert again.done == {0, 2, 4}
    again.close()
    src.close()


def test_records_survive_a_restart_and_corruption_is_found(tmp_path):
    src_root, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    store = ObjectStore(tmp_path / "p2p")
    store.add(LocalObject(m, src_root, set(range(len(m.checksums)))))
    store.close()
    w = src_root / "weights.bin"
    raw = bytearray(w.read_bytes())
    raw[CHUNK + 10] ^= 0xFF  # the weights' second chunk (index 3 overall) changes on disk
    w.write_bytes(bytes(raw))
    again = ObjectStore(tmp_path / "p2p")
    [obj] = again.load(tmp_path.resolve())
    weights_chunks = [s.index for s in obj.spans if m.files[s.file].path == "weights.bin"]
    assert obj.done == set(range(len(m.checksums))) - {weights_chunks[1]}
    with pytest.raises(ChunkCorrupt, match="corrupt on disk"):
        obj.read_chunk(weights_chunks[1])
    assert again.forget("obj") and not again.forget("obj")
    assert ObjectStore(tmp_path / "p2p").load(tmp_path.resolve()) == []
    assert w.exists()  # forgetting never deletes the files


@pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux", reason="mounting a tmpfs needs root")
def test_a_full_disk_is_an_error_before_any_chunk(tmp_path):
    _, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(small)], check=True)
    try:
        obj = LocalObject(m, small / "dst")
        with pytest.raises(DiskFull, match=r"needs \d+ more bytes at .*only \d+ free"):
            obj.prepare()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def _cluster(*stores: tuple[str, str]) -> Cluster:
    c = Cluster()
    for node_id, name in stores:
        c.upsert(Node(node_id, "store", node_id.encode(), {"store": "tcp://s", "p2p": f"tcp://{name}:1"},
                      NodeInfo(name, 1), time.monotonic()))
    return c


def test_index_tracks_holders_conflicts_and_removal(tmp_path):
    _, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    _, other = build_manifest("obj", make_tree(tmp_path / "other"), CHUNK)
    sent = []
    cluster = _cluster(("a-store", "a"), ("b-store", "b"))
    index = P2PIndex(cluster, lambda node_id, msg: sent.append((node_id, msg)))
    h = index.handlers()
    assert isinstance(h[Locate](Locate("obj"), ""), Failure)
    assert isinstance(h[Publish](Publish("a-store", m), ""), Done)
    conflict = h[Publish](Publish("b-store", other), "")
    assert isinstance(conflict, Failure) and conflict.code == "conflict" and "different content" in conflict.message
    assert isinstance(h[Publish](Publish("b-store", m), ""), Done)  # same content: another holder
    index.drop_node("b-store")
    assert isinstance(h[Have](Have("b-store", "obj", m.version, [0, 1]), ""), Done)
    assert isinstance(h[Have](Have("b-store", "obj", "0" * 64, [2]), ""), Failure)  # wrong version
    assert isinstance(h[Fetching](Fetching("b-store", "obj", [2, 3]), ""), Done)  # being fetched: soon held
    loc = h[Locate](Locate("obj"), "")
    assert isinstance(loc, Located) and loc.fetching[:5] == [0, 0, 1, 1, 0]
    held = {x.node_name: bits(x.chunks) for x in loc.holders}
    assert held == {"a": list(range(len(m.checksums))), "b": [0, 1]}
    del cluster.nodes["a-store"]  # a holder whose store is gone is not listed
    cluster.reindex()
    assert [x.node_name for x in h[Locate](Locate("obj"), "").holders] == ["b"]
    listing = h[ListObjects](ListObjects(), "")
    assert isinstance(listing, Listing) and listing.objects[0].holders == {"b": 2}
    assert isinstance(h[FindStore](FindStore("b"), ""), StoreAt)
    assert "no store registered for node 'z'" in h[FindStore](FindStore("z"), "").message
    assert isinstance(h[RemoveObject](RemoveObject("obj"), ""), Done)
    assert sorted(n for n, msg in sent if isinstance(msg, Forget)) == ["a-store", "b-store"]
    assert isinstance(h[Locate](Locate("obj"), ""), Failure)


def test_index_writes_only_from_the_node_they_name_and_manifests_bounded(tmp_path):
    """Under CURVE a store speaks only for itself (the key its node registered with); a manifest
    whose sizes would make a huge chunk list is refused by counting, not by listing its chunks."""
    import msgspec

    _, m = build_manifest("obj", make_tree(tmp_path / "src"), CHUNK)
    keys = {"a-store": "store:AAA", "b-store": "store:BBB"}
    index = P2PIndex(_cluster(("a-store", "a"), ("b-store", "b")), lambda node_id, msg: None,
                     lambda node_id, peer: keys.get(node_id) == peer)
    h = index.handlers()
    for msg in (Publish("b-store", m), Have("b-store", "obj", m.version, [0]), Fetching("b-store", "obj", [1])):
        refused = h[type(msg)](msg, "store:AAA")
        assert isinstance(refused, Failure) and refused.code == "unauthorized", msg
    assert "obj" not in index.objects
    assert isinstance(h[Publish](Publish("a-store", m), "store:AAA"), Done)
    refused = h[RemoveObject](RemoveObject("obj"), "worker:WWW")  # removal is cluster-wide: a store's key only
    assert isinstance(refused, Failure) and refused.code == "forbidden" and "obj" in index.objects
    assert isinstance(h[RemoveObject](RemoveObject("obj"), "store:BBB"), Done)
    assert isinstance(h[Publish](Publish("a-store", m), "store:AAA"), Done)
    first = m.files[0]
    huge = msgspec.structs.replace(m, files=[type(first)(first.path, 2**62, first.sha256)])
    failure = h[Publish](Publish("a-store", huge), "store:AAA")
    assert isinstance(failure, Failure) and failure.code == "bad_manifest" and "more than" in failure.message


async def test_gets_of_one_object_that_arrive_together_start_one_fetch(tmp_path, monkeypatch):
    """A node's prefill and decode ask their store for the same missing model at once: the second
    get, arriving while the first waits on the conductor, must not replace (and close) the first's
    object under its fetch."""
    import asyncio

    import zmq.asyncio

    from mooncake.protocol.p2p import GetObject
    from mooncake.p2p.service import P2PService

    _, m = build_manifest("model", make_tree(tmp_path / "src"), CHUNK)
    ctx = zmq.asyncio.Context()
    service = P2PService(ctx, "n2-store", tmp_path / "p2p", "tcp://127.0.0.1:*", "tcp://127.0.0.1:1",
                         root=tmp_path, node_key="k" * 64)

    async def locate(msg: Locate) -> Located:
        await asyncio.sleep(0.05)  # both gets wait here on the conductor
        return Located(m, [])

    spawned = []

    def spawn(coro) -> asyncio.Future:  # the fetch itself is not what this test is about
        coro.close()
        spawned.append(asyncio.get_running_loop().create_future())
        return spawned[-1]

    monkeypatch.setattr(service.meta, "call", locate)
    monkeypatch.setattr(service, "_spawn", spawn)
    dest = str(tmp_path / "dst")
    try:
        replies = await asyncio.gather(service._get(GetObject("model", dest)), service._get(GetObject("model", dest)))
        assert [r.message for r in replies] == ["fetching", "already fetching"] and len(spawned) == 1
        obj = service.fetches["model"].obj
        assert service.objects.objects["model"] is obj and not obj._closed
        with pytest.raises(ObjectError, match="being fetched into"):
            await service._get(GetObject("model", str(tmp_path / "elsewhere")))
    finally:
        await service.close()
        ctx.term()


@pytest.mark.parametrize("layout", ["data_under_root", "root_inside_data"])
async def test_a_tree_holding_or_inside_the_stores_data_is_never_published(tmp_path, monkeypatch, layout):
    """Both ways: a tree that holds the store's data directory or node key, and one inside that data
    directory, are refused before anything is read or announced. A p2p_root set apart inside the
    data directory (the default: <data_dir>/p2p-objects) is not the store's data."""
    import zmq.asyncio

    from mooncake.protocol.p2p import PutObject
    from mooncake.p2p.service import P2PService

    data = tmp_path / "data"
    root = tmp_path if layout == "data_under_root" else data / "p2p-objects"
    make_tree(data / "n1-store")  # what the store keeps there (its LMDB tier, its records)
    key = data / "p2p-n1.key"
    key.write_text("k" * 64)
    models = make_tree(root / "models")
    ctx = zmq.asyncio.Context()
    service = P2PService(ctx, "n1-store", data / "n1-store-p2p", "tcp://127.0.0.1:*", "tcp://127.0.0.1:1",
                         root=root, node_key="k" * 64, private=[data, key])
    published = []

    async def publish(msg: Publish) -> Done:
        published.append(msg.manifest.name)
        return Done()

    monkeypatch.setattr(service.meta, "call", publish)
    refused = [data / "n1-store", data / "n1-store" / "sub", key] if layout == "data_under_root" else []
    refused += [tmp_path, data] if layout == "data_under_root" else []
    try:
        for path in refused:
            with pytest.raises(ObjectError, match="this store's node key or data"):
                await service._put(PutObject("leak", str(path)))
        assert published == []
        assert isinstance(await service._put(PutObject("model", str(models))), Done)
        assert published == ["model"]
    finally:
        await service.close()
        ctx.term()
