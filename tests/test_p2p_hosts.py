"""P2P distribution across four network namespaces with egress caps and CURVE: a 300 MB
object published on host1 and fetched at the same time by hosts 2, 3 and 4 (SHA-256
identical, the fetchers serving each other), then a holder killed mid-transfer."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from mooncake.testing.hosts import leftovers, unavailable_reason
from mooncake.testing.p2p_hosts import P2PHosts

UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)]
SIZE = 300 * 1000 * 1000


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(8 << 20):
            h.update(b)
    return h.hexdigest()


def write_random(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(4 << 20)
    with open(path, "wb") as f:
        for off in range(0, size, len(block)):  # distinct chunks: each block salted with its offset
            f.write((off.to_bytes(8, "little") + block[8:])[: size - off])


async def fetch_all(net: P2PHosts, hosts: list[int], dests: dict[int, Path]) -> dict:
    clients = {i: net.client(i) for i in hosts}
    try:
        reports = await asyncio.gather(*(clients[i].get("blob", dests[i]) for i in hosts))
        return dict(zip(hosts, reports))
    finally:
        for c in clients.values():
            c.close()


def test_a_300mb_object_spreads_to_three_hosts_and_survives_a_holder_dying(tmp_path):
    src = tmp_path / "src" / "blob.bin"
    write_random(src, SIZE)
    want = sha256(src)
    with P2PHosts(tmp_path / "hosts", rate="1gbit") as net:
        published = net.cli(1, "put", "blob", str(src.parent))
        assert published.returncode == 0, published.stderr + net.hosts.logs()
        dests = {i: tmp_path / f"dst{i}" for i in (2, 3, 4)}
        reports = asyncio.run(fetch_all(net, [2, 3, 4], dests))
        for i in (2, 3, 4):
            assert sha256(dests[i] / "blob.bin") == want, f"host{i}"
        assert all(r.bulk_bytes == 0 for r in reports.values())  # CURVE: every byte over ZeroMQ
        from_peers = sum(b for r in reports.values() for name, b in r.peers.items() if name != "host1")
        assert from_peers > 0, {i: r.peers for i, r in reports.items()}  # fetchers served each other
        listing = net.cli(2, "ls")
        assert "host1 complete, host2 complete, host3 complete, host4 complete" in listing.stdout, listing

        # host4 fetches again into a new directory from hosts 1-3, slowed down; host2 dies midway
        for i in (1, 2, 3):
            net.set_rate(i, "200mbit")

        async def fetch_while_killing() -> object:
            client = net.client(4)
            killed = asyncio.Event()

            def on_progress(report) -> None:
                if not killed.is_set() and report.peers.get("host2", 0) > 0:
                    net.kill_store(2)
                    killed.set()

            try:
                return await client.get("blob", tmp_path / "again", on_progress, poll_s=0.05)
            finally:
                client.close()
                assert killed.is_set(), "the fetch ended before host2 served anything"

        report = asyncio.run(fetch_while_killing())
        assert sha256(tmp_path / "again" / "blob.bin") == want
        assert report.peers.get("host1", 0) + report.peers.get("host3", 0) > 0
    assert leftovers() == []
