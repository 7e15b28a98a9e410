"""The store server in real subprocesses: round trips, robustness, persistence, replication."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from mooncake.kv.integrity import checksums
from mooncake.protocol import Error, Get, Put, decode, encode
from mooncake.testing.store_process import store_process
from mooncake.tiers.client import StoreClient, StoreError, StoreUnavailable

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def hashes(prefix: str, n: int) -> list[bytes]:
    return [(prefix.encode() + i.to_bytes(4, "big")).ljust(32, b"\0") for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with store_process(tmp_path_factory.mktemp("srv"), "--dram-bytes", str(256 * MiB),
                       "--lmdb-bytes", str(64 * MiB)) as ep:
        yield ep


@pytest.mark.parametrize("shm", [False, True])
async def test_concurrent_clients_round_trip_large_blocks(server, shm):
    async def one(c: int) -> None:
        client = StoreClient(server, shm=shm)
        try:
            hs = hashes(f"c{c}{shm}", 3)
            blocks = torch.randn(3, 2, 2, 4, 64, 256)  # 3 x 1 MiB
            assert await client.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 3
            got_h, got = await client.get(hs + hashes("missing", 1) + hs[:1], prefix=True)
            assert got_h == hs
            assert all(torch.equal(a, b) for a, b in zip(got, blocks.unbind(0)))
            _, some = await client.get(hashes("missing", 1) + hs[1:2], prefix=False)
            assert len(some) == 1 and torch.equal(some[0], blocks[1])
        finally:
            client.close()

    await asyncio.gather(*(one(c) for c in range(4)))
    client = StoreClient(server)
    stats = await client.stats()
    client.close()
    assert stats["hits"] >= 16 and stats["tiers"][0]["used_bytes"] >= 12 * MiB


@pytest.mark.parametrize("shm", [False, True])
async def test_a_flex_requests_blocks_are_marked_flex_in_the_store(server, shm):
    """``flex`` crosses the wire (frames or shared memory): the store counts them as flex."""
    c = StoreClient(server, shm=shm)
    try:
        before = {t["name"]: t["flex_blocks"] for t in (await c.stats())["tiers"]}
        flex, chat = torch.randn(2, 64, 1024), torch.randn(2, 64, 1024)
        assert await c.put(hashes(f"flex{shm}", 2), flex, checksums=checksums(flex), flex=True) == 2
        assert await c.put(hashes(f"chat{shm}", 2), chat, checksums=checksums(chat)) == 2
        after = {t["name"]: t["flex_blocks"] for t in (await c.stats())["tiers"]}
        assert after["dram"] - before["dram"] == 2
    finally:
        c.close()


@pytest.mark.parametrize("shm", [False, True])
async def test_a_sessions_blocks_are_kept_in_the_store(server, shm):
    """``keep_s`` crosses the wire with a put (frames or shared memory); ``Keep`` keeps blocks held already."""
    c = StoreClient(server, shm=shm)
    try:
        before = sum(t["session_blocks"] for t in (await c.stats())["tiers"])
        turn, old = torch.randn(2, 64, 1024), torch.randn(3, 64, 1024)
        assert await c.put(hashes(f"turn{shm}", 2), turn, checksums=checksums(turn), keep_s=300) == 2
        assert await c.put(hashes(f"old{shm}", 3), old, checksums=checksums(old)) == 3
        assert await c.keep([*hashes(f"old{shm}", 3), *hashes(f"absent{shm}", 1)], 300) == 3
        after = sum(t["session_blocks"] for t in (await c.stats())["tiers"])
        assert after - before == 5
    finally:
        c.close()


async def test_object_api_exists_remove_stats(server):
    c = StoreClient(server)
    try:
        hs = hashes("api", 4)
        blocks = [torch.arange(8, dtype=torch.int32) + i for i in range(3)]
        await c.put(hs[:3], blocks, checksums=checksums(blocks))
        assert await c.exists(hs) == [True, True, True, False]
        got_h, got = await c.get(hs)
        assert got_h == hs[:3] and got[2].dtype == torch.int32 and got[2][0] == 2
        assert await c.remove(hs[1:2] + hs[3:]) == 1
        assert await c.exists(hs) == [True, False, True, False]
        stats = await c.stats()
        assert stats["hot"] and {t["name"] for t in stats["tiers"]} == {"dram", "lmdb"}
    finally:
        c.close()


async def test_malformed_and_unknown_messages_get_errors(server):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server)
    try:
        bad = [
            [b"r1", b"\xc1garbage"],  # not msgpack
            [b"r2", b'\x81\xa1t\xa7nothing'],  # unknown tag
            [b"r3", encode(Put([b"x"], []))[0]],  # declares no tensors, hash without a block
            [b"r4", *encode(Get([b"x"]))[:1], b"extra frame"],
            [b"r5"],  # no message at all
            [b"r6", encode(Error("I am not a request"))[0]],
        ]
        for frames in bad:
            await sock.send_multipart(frames)
            reply = await asyncio.wait_for(sock.recv_multipart(), 10)
            assert reply[0] == frames[0]
            msg, _ = decode(reply[1:])
            assert isinstance(msg, Error), frames
        c = StoreClient(server)
        try:
            assert await c.exists(hashes("nothing", 2)) == [False, False]  # still serving
        finally:
            c.close()
    finally:
        sock.close()
        ctx.term()


async def test_client_times_out_instead_of_hanging():
    c = StoreClient("tcp://127.0.0.1:9", timeout_s=0.3)
    try:
        with pytest.raises(StoreUnavailable):
            await c.exists([b"x" * 32])
    finally:
        c.close()
    assert issubclass(StoreUnavailable, StoreError)


async def test_persistence_across_restart(tmp_path):
    hs = hashes("persist", 6)
    blocks = torch.randn(6, 2, 2, 4, 32, 128).to(torch.bfloat16)  # 64 KiB each
    args = ("--dram-bytes", str(128 * 1024), "--lmdb-bytes", str(16 * MiB))
    with store_process(tmp_path, *args) as ep:
        c = StoreClient(ep)
        assert await c.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 6  # most get demoted to LMDB
        stats = await c.stats()
        c.close()
        assert stats["tiers"][1]["blocks"] >= 4
    with store_process(tmp_path, *args) as ep:  # a new process on the same directory
        c = StoreClient(ep)
        try:
            on_disk = (await c.stats())["tiers"][1]["blocks"]
            assert on_disk == 6  # SIGTERM moved the DRAM blocks to LMDB too
            got_h, got = await c.get(hs, prefix=False)
            assert got_h == hs
            for g, b in zip(got, blocks.unbind(0)):
                assert g.dtype == torch.bfloat16 and torch.equal(g, b)
        finally:
            c.close()


async def test_replication_between_two_stores(tmp_path):
    with store_process(tmp_path / "a") as src, store_process(tmp_path / "b") as dst:
        a, b = StoreClient(src), StoreClient(dst)
        try:
            hs = hashes("rep", 5)
            blocks = torch.randn(5, 2, 2, 2, 16, 128)
            await a.put(hs[:4], blocks[:4], model_id="mod", checksums=checksums(blocks[:4]))
            assert await a.replicate(hs, dst) == 4
            got_h, got = await b.get(hs, prefix=True)
            assert got_h == hs[:4] and all(torch.equal(x, y) for x, y in zip(got, blocks[:4].unbind(0)))
            with pytest.raises(StoreError):
                await a.replicate(hs[:1], "bogus://nowhere")  # unusable target: an error reply, not a hang
        finally:
            a.close()
            b.close()


async def test_puts_travel_apart_from_reads_and_wait_longer_the_more_they_carry():
    """A read never queues behind a write-back on the client's socket (on a slow link a long
    prompt's writes took longer than a read's timeout): puts go on a socket of their own, and a
    call waits a second more per MB queued before it on its socket (a stub store that answers
    reads at once and never answers puts)."""
    from mooncake.protocol import Exists, Ok

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: dict[str, set[bytes]] = {"put": set(), "read": set()}

    async def serve() -> None:
        while True:
            ident, rid, *frames = await router.recv_multipart()
            msg = decode(frames)[0]
            if isinstance(msg, Put):
                seen["put"].add(ident)
            else:
                seen["read"].add(ident)
                assert isinstance(msg, Exists)
                await router.send_multipart([ident, rid, *encode(Ok(flags=[False] * len(msg.hashes)))])

    stub = asyncio.create_task(serve())
    c = StoreClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3, shm=False)
    try:
        put = asyncio.create_task(c.put(hashes("slow", 2), torch.zeros(2, 1 << 18)))  # 2 MiB, never answered
        await asyncio.sleep(0.05)
        assert await c.exists(hashes("q", 3)) == [False, False, False]  # answered while the put waits
        assert seen["put"] and seen["read"] and not seen["put"] & seen["read"]  # two sockets
        with pytest.raises(StoreUnavailable, match="within 2s"):  # 0.3 s, and 2 MiB queued
            await put
        assert c._queued_bytes == {"puts": 0, "main": 0}
    finally:
        c.close()
        stub.cancel()
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("shm", [False, True])
async def test_a_put_without_checksums_is_refused_and_counted(tmp_path, shm):
    """Stored without its writer's checksum, a block would be served unchecked (checksum 0): the store
    answers such a put with an error, counts its blocks as refused, stores none, and serves on."""
    from mooncake.config import StoreConfig
    from mooncake.tiers.server import StoreServer
    from mooncake.tiers.tiered import TieredStore

    store = TieredStore.from_config(StoreConfig(dram_bytes=16 * MiB, lmdb_bytes=0, data_dir=str(tmp_path)), "s")
    server = StoreServer(store, "tcp://127.0.0.1:0")
    c = StoreClient(await server.start(), shm=shm, shm_min_bytes=0)
    try:
        hs, blocks = hashes(f"unsummed{shm}", 2), torch.randn(2, 64, 256)
        with pytest.raises(StoreError, match="without checksums"):
            await c.put(hs, blocks, model_id="m")
        with pytest.raises(StoreError, match="checksum"):  # one checksum for two blocks
            await c.put(hs, blocks, model_id="m", checksums=checksums(blocks)[:1])
        assert await c.exists(hs) == [False, False]
        assert server.rejections.snapshot() == {"checksum": 4}
        assert await c.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 2
    finally:
        c.close()
        await server.close()
        store.close()
