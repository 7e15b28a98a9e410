"""The store's same-node shared-memory path: segments reused, bounded, and given up safely; the
copies in and out of a segment byte-exact for every layout; checksums still checked on puts."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from mooncake.config import StoreConfig
from mooncake.kv.integrity import checksums
from mooncake.tiers.client import StoreClient, StoreError
from mooncake.tiers.server import StoreServer
from mooncake.tiers.shm import SHM_DIR, SegmentPool, ShmSegment, shm_available
from mooncake.tiers.tiered import TieredStore

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm")
MiB = 1 << 20
BLOCK = (30, 2, 16, 3, 64)  # 368,640 bytes in float16: the served model's KV block


def hashes(prefix: str, n: int) -> list[bytes]:
    return [(prefix.encode() + i.to_bytes(4, "big")).ljust(32, b"\0") for i in range(n)]


@pytest.fixture
async def server(tmp_path):
    store = TieredStore.from_config(StoreConfig(dram_bytes=256 * MiB, lmdb_bytes=0, data_dir=str(tmp_path)), "s")
    srv = StoreServer(store, "tcp://127.0.0.1:0")
    await srv.start()
    yield srv
    await srv.close()
    store.close()


@pytest.mark.parametrize("layout", ["batch", "separate", "strided", "bfloat16", "odd"])
def test_blocks_written_to_a_segment_read_back_byte_exact(layout):
    kv = torch.randn(4, *BLOCK).half()
    blocks = {"batch": list(kv.unbind(0)),  # back to back in one tensor: one memcpy
              "separate": [b.clone() for b in kv.unbind(0)],
              "strided": list(torch.randn(4, 64, 96).transpose(1, 2).unbind(0)),
              "bfloat16": list(torch.randn(3, 8, 128).bfloat16().unbind(0)),
              "odd": [torch.randn(7), torch.randn(()), torch.randint(0, 9, (5, 3), dtype=torch.int8)]}[layout]
    seg = ShmSegment(size=16 * MiB, create=True)
    try:
        refs = seg.write_blocks(blocks)
        assert all(r.offset % 64 == 0 for r in refs)
        back = [seg.read(r.offset, r.spec) for r in refs]
        assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(back, blocks))
        assert back[0].data_ptr() != seg.view(refs[0].offset, refs[0].spec).data_ptr()  # a copy, not the segment
        with pytest.raises(ValueError):
            seg.write_blocks([torch.empty(17 * MiB, dtype=torch.uint8)])
    finally:
        seg.close()
    assert not os.path.exists(os.path.join(SHM_DIR, seg.name))


def test_a_pool_reuses_its_segments_and_stays_within_its_limits():
    pool = SegmentPool(max_bytes=64 * MiB, max_segments=2)
    try:
        a = pool.take(12 * MiB)
        assert a is not None and a.size == 16 * MiB
        pool.give(a)
        assert pool.take(1 * MiB) is a  # reused, not a fresh segment
        b = pool.take(20 * MiB)
        assert b is not None and b.size == 32 * MiB
        assert pool.take(1 * MiB) is None  # both busy: the caller takes the socket
        pool.give(a)
        c = pool.take(32 * MiB)  # none free fits, at the limit: the small free one makes room
        assert c is not None and c.size == 32 * MiB and a not in pool.all and len(pool.all) == 2
        pool.give(b)
        pool.give(c)
        assert pool.take(64 * MiB) is None  # over max_bytes even after a free one makes room
        pool.drop(b)
        assert b not in pool.all and not os.path.exists(os.path.join(SHM_DIR, b.name))
        pool.give(b)  # a dropped segment never comes back
        assert b not in pool.free
    finally:
        pool.close()


async def test_puts_and_gets_of_model_blocks_reuse_one_segment(server):
    c = StoreClient(server.endpoint, shm=True)
    try:
        for i in range(5):
            kv = torch.randn(32, *BLOCK).half()
            hs = hashes(f"b{i}", 32)
            assert await c.put(hs, kv, model_id="m", checksums=checksums(kv)) == 32
            got_h, got = await c.get(hs)
            assert got_h == hs and torch.equal(torch.stack(got), kv)
        assert c.shm and len(c._segs.all) == 1  # one 16 MiB segment served all ten requests
        assert len(server.requests._segments) == 1
    finally:
        c.close()


async def test_concurrent_puts_use_at_most_max_segments_and_the_socket_beyond(server):
    c = StoreClient(server.endpoint, shm=True, shm_max_segments=2)
    kvs = [torch.randn(8, *BLOCK).half() for _ in range(6)]
    try:
        counts = await asyncio.gather(*(c.put(hashes(f"p{i}", 8), kv, model_id="m", checksums=checksums(kv))
                                        for i, kv in enumerate(kvs)))
        assert counts == [8] * 6 and len(c._segs.all) <= 2
        for i, kv in enumerate(kvs):
            _, got = await c.get(hashes(f"p{i}", 8))
            assert torch.equal(torch.stack(got), kv)
    finally:
        c.close()


async def test_a_segment_the_store_cannot_open_sends_the_client_to_the_socket(server):
    c = StoreClient(server.endpoint, shm=True, shm_min_bytes=0)
    try:
        seg = c._segs.take(1)
        os.unlink(os.path.join(SHM_DIR, seg.name))  # gone before the store ever attached it
        c._segs.give(seg)
        kv = torch.randn(2, *BLOCK).half()
        assert await c.put(hashes("gone", 2), kv, model_id="m", checksums=checksums(kv)) == 2
        assert not c.shm  # the socket from now on
        _, got = await c.get(hashes("gone", 2))
        assert torch.equal(torch.stack(got), kv)
    finally:
        c.close()


async def test_a_closed_clients_segments_are_unmapped_by_the_store(server):
    first = StoreClient(server.endpoint, shm=True)
    kv = torch.randn(4, *BLOCK).half()
    await first.put(hashes("first", 4), kv, model_id="m", checksums=checksums(kv))
    first.close()
    second = StoreClient(server.endpoint, shm=True)
    try:
        await second.put(hashes("second", 4), kv, model_id="m", checksums=checksums(kv))
        assert len(server.requests._segments) == 1  # the first client's (unlinked) segment is closed
    finally:
        second.close()


async def test_a_shm_put_whose_bytes_differ_from_their_checksums_is_refused(server):
    c = StoreClient(server.endpoint, shm=True, shm_min_bytes=0)
    try:
        kv = torch.randn(4, *BLOCK).half()
        sums = checksums(kv)
        sums[2] ^= 1
        with pytest.raises(StoreError, match="block 2 does not match its checksum"):
            await c.put(hashes("bad", 4), kv, model_id="m", checksums=sums)
        assert await c.exists(hashes("bad", 4)) == [False] * 4
        assert server.rejections.snapshot() == {"checksum": 4}
    finally:
        c.close()
