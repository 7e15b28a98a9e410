"""The bulk data path for chunk bytes (mooncake/p2p/bulk.py, bulk_server.py): in process (tokens, cut, stalled,
truncated and corrupt streams, a port refusing or ignoring connections, a configured port; a holder's bounds
against hostile peers: idle connections, the connection cap, failed accepts, grant floods),
through a store's P2P socket (a token under plain TCP, never under CURVE), and end to end
between real stores on loopback (a holder whose bulk port is closed served over ZeroMQ) and
across network namespaces."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from mooncake.p2p.bulk import HEADER, BulkLost, BulkPool, BulkUnreachable
from mooncake.p2p.bulk_server import CLOSED_ENV, CUT_ENV, MAX_GRANTS, MAX_GRANTS_PER_PEER, BulkServer
from mooncake.p2p.manifest import build_manifest
from mooncake.protocol.p2p import ChunkData, ChunkGet, decoder, encoder
from mooncake.p2p.objects import LocalObject
from mooncake.p2p.service import P2PService
from mooncake.security import Curve, generate_keys
from mooncake.testing.hosts import unavailable_reason

pytestmark = pytest.mark.timeout(180)
CHUNK = 256 * 1024


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def published(tmp_path: Path, size: int = 5 * CHUNK + 777) -> tuple[LocalObject, LocalObject]:
    """(a holder of a one-file object, a fresh destination for it, its files reserved)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "blob.bin").write_bytes(os.urandom(size))
    root, m = build_manifest("blob", tmp_path / "src", CHUNK)
    dst = LocalObject(m, tmp_path / "dst")
    dst.prepare()
    return LocalObject(m, root, set(range(len(m.checksums)))), dst


async def fetch(pool: BulkPool, token: bytes, dst: LocalObject, index: int) -> bool:
    with ThreadPoolExecutor(1) as ex:
        return await asyncio.get_running_loop().run_in_executor(ex, pool.fetch, token, dst, index)


async def test_granted_chunks_arrive_byte_identical_over_one_reused_connection(tmp_path):
    holder, dst = published(tmp_path)
    server = BulkServer("127.0.0.1")
    server.start()
    pool = BulkPool("127.0.0.1", server.port)
    try:
        for i in range(len(dst.spans)):
            assert await fetch(pool, server.grant(holder, i, "127.0.0.1"), dst, i)
        assert len(pool._idle) == 1  # one connection, reused
    finally:
        pool.close()
        await server.close()
        dst.close()
    assert sha(tmp_path / "dst" / "blob.bin") == sha(tmp_path / "src" / "blob.bin")


async def test_unknown_replayed_expired_and_foreign_tokens_are_refused(tmp_path):
    holder, dst = published(tmp_path)
    server, stale = BulkServer("127.0.0.1"), BulkServer("127.0.0.1", ttl_s=0.0)
    server.start()
    stale.start()
    try:
        with pytest.raises(BulkLost, match="closed the connection"):
            await fetch(BulkPool("127.0.0.1", server.port), os.urandom(16), dst, 0)
        token = server.grant(holder, 0, "127.0.0.1")
        assert await fetch(BulkPool("127.0.0.1", server.port), token, dst, 0)
        with pytest.raises(BulkLost, match="closed the connection"):  # a token serves once
            await fetch(BulkPool("127.0.0.1", server.port), token, dst, 0)
        with pytest.raises(BulkLost, match="closed the connection"):
            await fetch(BulkPool("127.0.0.1", stale.port), stale.grant(holder, 1, "127.0.0.1"), dst, 1)
        with pytest.raises(BulkLost, match="closed the connection"):  # granted to another address
            await fetch(BulkPool("127.0.0.1", server.port, source="127.0.0.2"), server.grant(holder, 1, "127.0.0.1"),
                        dst, 1)
    finally:
        await server.close()
        await stale.close()
        dst.close()


async def test_cut_truncated_and_corrupt_streams_never_count(tmp_path, monkeypatch):
    holder, dst = published(tmp_path)
    monkeypatch.setenv(CUT_ENV, "1")
    cut = BulkServer("127.0.0.1")  # a holder that dies halfway through every chunk
    monkeypatch.delenv(CUT_ENV)
    shorts: asyncio.Queue = asyncio.Queue()
    truncated = BulkServer("127.0.0.1", on_short=lambda obj, i: shorts.put_nowait(i))
    corrupt = BulkServer("127.0.0.1", corrupt=True)
    for s in (cut, truncated, corrupt):
        s.start()
    try:
        with pytest.raises(BulkLost, match="cut off"):
            await fetch(BulkPool("127.0.0.1", cut.port), cut.grant(holder, 0, "127.0.0.1"), dst, 0)
        assert not await fetch(BulkPool("127.0.0.1", corrupt.port), corrupt.grant(holder, 1, "127.0.0.1"), dst, 1)
        last = len(dst.spans) - 1
        token = truncated.grant(holder, last, "127.0.0.1")
        os.truncate(tmp_path / "src" / "blob.bin", holder.spans[last].offset + 100)  # shrank under the holder
        with pytest.raises(BulkLost, match="cut off 100 bytes"):
            await fetch(BulkPool("127.0.0.1", truncated.port), token, dst, last)
        assert await asyncio.wait_for(shorts.get(), 10) == last  # the holder checks its copy
    finally:
        for s in (cut, truncated, corrupt):
            await s.close()
        dst.close()


async def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def closed_by_peer(sock: socket.socket, timeout_s: float = 3.0) -> bool:
    """Whether the other end closes ``sock`` within ``timeout_s`` (sending nothing)."""
    sock.settimeout(timeout_s)
    try:
        return await asyncio.to_thread(sock.recv, 1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def recv_chunk(sock: socket.socket) -> int:
    """In a thread: a chunk's header and bytes; its length."""
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = sock.recv(n - len(buf))
            assert got, "closed mid-chunk"
            buf += got
        return buf

    length = HEADER.unpack(exact(HEADER.size))[0]
    exact(length)
    return length


async def test_a_connection_that_brings_no_whole_token_in_time_is_closed(tmp_path):
    holder, dst = published(tmp_path)
    server = BulkServer("127.0.0.1", idle_timeout_s=0.3)
    server.start()
    silent, halfway, after = (socket.create_connection(("127.0.0.1", server.port)) for _ in range(3))
    try:
        halfway.sendall(b"x" * 8)  # half a token, then nothing
        after.sendall(server.grant(holder, 0, "127.0.0.1"))  # a chunk, then nothing
        assert await asyncio.to_thread(recv_chunk, after) == holder.spans[0].length
        for sock in (silent, halfway, after):
            assert await closed_by_peer(sock)
        await wait_until(lambda: not server._conns)
    finally:
        for sock in (silent, halfway, after):
            sock.close()
        await server.close()
        dst.close()


async def test_a_fetcher_does_not_reuse_a_connection_the_holder_may_have_closed(tmp_path):
    holder, dst = published(tmp_path)
    server = BulkServer("127.0.0.1", idle_timeout_s=0.3)
    server.start()
    pool = BulkPool("127.0.0.1", server.port, reuse_s=0.15)
    try:
        assert await fetch(pool, server.grant(holder, 0, "127.0.0.1"), dst, 0)
        await asyncio.sleep(0.6)  # the holder closed the idle connection
        assert await fetch(pool, server.grant(holder, 1, "127.0.0.1"), dst, 1)  # on a new one
        assert len(pool._idle) == 1
    finally:
        pool.close()
        await server.close()
        dst.close()


async def test_connections_over_the_global_cap_are_closed_at_once_and_logged_once_in_a_while(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mooncake.p2p.bulk_server")
    holder, dst = published(tmp_path)
    server = BulkServer("127.0.0.1", max_connections=2)
    server.start()
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
    over: list[socket.socket] = []
    pool = BulkPool("127.0.0.1", server.port, timeout_s=3)
    try:
        await wait_until(lambda: len(server._conns) == 2)
        for _ in range(3):
            over.append(socket.create_connection(("127.0.0.1", server.port)))
            assert await closed_by_peer(over[-1])
        refused = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
        assert refused == ["p2p bulk: connection refused: 2 open (1x)"]  # the others counted for the next line
        held.pop().close()
        await wait_until(lambda: len(server._conns) == 1)
        assert await fetch(pool, server.grant(holder, 0, "127.0.0.1"), dst, 0)  # under the cap: served
    finally:
        for sock in held + over:
            sock.close()
        pool.close()
        await server.close()
        dst.close()


async def test_failed_accepts_do_not_stop_the_bulk_port(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="mooncake.p2p.bulk_server")
    holder, dst = published(tmp_path)
    loop = asyncio.get_running_loop()
    accept, failures = loop.sock_accept, 3

    async def out_of_files(sock: socket.socket) -> tuple[socket.socket, object]:
        nonlocal failures
        if failures:
            failures -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return await accept(sock)

    monkeypatch.setattr(loop, "sock_accept", out_of_files)
    server = BulkServer("127.0.0.1")
    server.start()
    pool = BulkPool("127.0.0.1", server.port, timeout_s=3)
    try:
        assert await fetch(pool, server.grant(holder, 0, "127.0.0.1"), dst, 0)
        assert failures == 0
        failed = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
        assert failed == [f"p2p bulk: accept failed: {os.strerror(errno.EMFILE)} (1x)"]  # not one line each
    finally:
        pool.close()
        await server.close()
        dst.close()


async def test_one_peer_flooding_grants_drops_its_own_not_another_peers(tmp_path):
    holder, dst = published(tmp_path)
    server = BulkServer("127.0.0.1")
    server.start()
    other = server.grant(holder, 0, "127.0.0.1")
    flood = [server.grant(holder, 1, "127.0.0.2") for _ in range(MAX_GRANTS)]
    try:
        assert await fetch(BulkPool("127.0.0.1", server.port), other, dst, 0)
        assert len(server._grants) == MAX_GRANTS_PER_PEER  # the flooder's newest only
        with pytest.raises(BulkLost, match="closed the connection"):  # the flooder's oldest went first
            await fetch(BulkPool("127.0.0.1", server.port, source="127.0.0.2"), flood[0], dst, 1)
        assert await fetch(BulkPool("127.0.0.1", server.port, source="127.0.0.2"), flood[-1], dst, 1)
    finally:
        await server.close()
        dst.close()


async def test_a_silent_holder_times_out(tmp_path):
    _, dst = published(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:  # reads the token, sends the header, then nothing
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.recv(16)
        conn.sendall(HEADER.pack(dst.spans[0].length) + b"x" * 10)

    loop = asyncio.get_running_loop()
    server = loop.run_in_executor(None, serve)
    try:
        with pytest.raises(BulkLost, match="cut off 10 bytes"):
            await fetch(BulkPool("127.0.0.1", listener.getsockname()[1], timeout_s=0.5), os.urandom(16), dst, 0)
        await server
    finally:
        for c in accepted:
            c.close()
        listener.close()
        dst.close()


async def test_a_bulk_port_refusing_or_ignoring_connections_is_unreachable(tmp_path):
    _, dst = published(tmp_path)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # refused
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)  # one pending connection fills its queue: the next SYNs are dropped, as by a firewall
    waiting = socket.create_connection(full.getsockname())
    try:
        with pytest.raises(BulkUnreachable, match="cannot connect"):
            await fetch(BulkPool("127.0.0.1", port), os.urandom(16), dst, 0)
        with pytest.raises(BulkUnreachable, match="timed out"):
            await fetch(BulkPool("127.0.0.1", full.getsockname()[1], connect_timeout_s=0.5), os.urandom(16), dst, 0)
        assert issubclass(BulkUnreachable, BulkLost)  # a fetch that knows only BulkLost still asks again
    finally:
        waiting.close()
        full.close()
        dst.close()


async def test_a_configured_bulk_port_is_the_one_listened_on_and_a_taken_one_is_a_clear_error(tmp_path):
    from mooncake.testing.ports import free_port

    holder, dst = published(tmp_path)
    port = free_port()
    ctx = zmq.asyncio.Context()
    service = P2PService(ctx, "n1-store", tmp_path / "p2p", "tcp://127.0.0.1:*", "tcp://127.0.0.1:1", bulk_port=port,
                         root=tmp_path, node_key="k" * 64)
    service.start()
    service.objects.add(holder)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    try:
        assert service.bulk is not None and service.bulk.port == port
        head = decoder.decode((await chunk_get(service, sock, bulk=True))[0])
        assert head.bulk_port == port  # what fetchers are told to connect to
        assert await fetch(BulkPool("127.0.0.1", port), head.token, dst, 0)
        with pytest.raises(OSError, match=rf"P2P bulk port 127.0.0.1:{port} \(\[node\] p2p_bulk_port\)"):
            BulkServer("127.0.0.1", port)
    finally:
        sock.close(0)
        await service.close()
        ctx.term()
        dst.close()


def test_a_store_whose_bulk_port_is_taken_exits_with_the_reason(tmp_path):
    import subprocess
    import sys

    from mooncake.testing.ports import free_port

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env.update(MOONCAKE_NODE_P2P_BULK_PORT=str(port), MOONCAKE_STORE_DATA_DIR=str(tmp_path / "data"),
               MOONCAKE_STORE_LMDB_BYTES="0", MOONCAKE_CONDUCTOR_ENDPOINT=f"tcp://127.0.0.1:{free_port()}")
    try:
        r = subprocess.run([sys.executable, "-m", "mooncake.cli", "serve", "--role", "store"], env=env,
                           capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert r.returncode != 0
    assert f"P2P bulk port 127.0.0.1:{port} ([node] p2p_bulk_port): Address already in use" in r.stderr, r.stderr


async def chunk_get(service: P2PService, sock: zmq.asyncio.Socket, bulk: bool) -> list:
    await sock.send(encoder.encode(ChunkGet(1, "blob", service.objects.objects["blob"].manifest.version, 0, bulk=bulk)))
    return await asyncio.wait_for(sock.recv_multipart(), 10)


@pytest.mark.parametrize("secure", [False, True])
async def test_a_store_grants_bulk_tokens_without_curve_and_never_under_curve(tmp_path, secure):
    holder, dst = published(tmp_path)
    dst.close()
    curve = client_curve = None
    if secure:
        generate_keys(tmp_path / "keys")
        curve, client_curve = Curve(tmp_path / "keys", "store"), Curve(tmp_path / "keys", "store")
    ctx = zmq.asyncio.Context()
    service = P2PService(ctx, "n1-store", tmp_path / "p2p", "tcp://127.0.0.1:*", "tcp://127.0.0.1:1", curve,
                         root=tmp_path, node_key="k" * 64)
    service.start()
    service.objects.add(holder)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if client_curve is not None:
        client_curve.client(sock, "store")
    sock.connect(service.endpoint)
    try:
        frames = await chunk_get(service, sock, bulk=True)
        head = decoder.decode(frames[0])
        assert isinstance(head, ChunkData) and not head.missing
        if secure:  # the bytes stay on the encrypted socket
            assert service.bulk is None and not head.token and frames[1] == (tmp_path / "src" / "blob.bin").read_bytes()[:CHUNK]
        else:
            assert len(frames) == 1 and len(head.token) == 16 and head.bulk_port == service.bulk.port
            assert len((await chunk_get(service, sock, bulk=False))[1]) == CHUNK  # the old path still serves
    finally:
        sock.close(0)
        await service.close()
        if curve is not None:
            curve.stop()
        ctx.term()


# ---- real stores


def test_fetches_go_over_bulk_ports_and_a_holder_cutting_streams_is_left_for_another(tmp_path):
    from p2p_nodes import P2PNodes
    from test_p2p_cluster import ok, same_tree, tree

    src = tree(tmp_path / "src", 1, mib=6)
    with P2PNodes(tmp_path / "nodes", ["n1", "cut", "n3"], store_env={"cut": {CUT_ENV: "1"}}, stall_timeout_s=4.0) as nodes:
        ok(nodes.cli("cut", "put", "model", str(src)))
        r = nodes.cli("n3", "get", "model", str(tmp_path / "none"))  # every stream of the only holder cut off
        assert r.returncode == 1 and "no progress" in r.stderr, r.stderr
        ok(nodes.cli("n1", "put", "model", str(src)))
        out = ok(nodes.cli("n3", "get", "model", str(tmp_path / "dst")))
        assert "from: n1" in out and "cut" not in out.split("from:")[1], out
        assert same_tree(src, tmp_path / "dst")
        assert "cut off" in (tmp_path / "nodes" / "n3.log").read_text()  # it went over the bulk port


def test_a_holder_whose_bulk_port_is_closed_serves_over_zeromq_and_a_configured_port_serves_bulk(tmp_path):
    from mooncake.testing.ports import free_port
    from p2p_nodes import P2PNodes
    from test_p2p_cluster import same_tree, tree

    from mooncake.config import load_config
    from mooncake.p2p.client import P2PClient

    src = tree(tmp_path / "src", 1, mib=6)
    size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
    port = free_port()
    env = {"closed": {CLOSED_ENV: "1"}, "fixed": {"MOONCAKE_NODE_P2P_BULK_PORT": str(port)}}
    with P2PNodes(tmp_path / "nodes", ["closed", "fixed", "n3"], store_env=env) as nodes:

        async def get(name: str, dest: Path, holder: str) -> object:
            publisher, client = (P2PClient(load_config(nodes.config(n), env={})) for n in (holder, "n3"))
            try:
                assert "published" in await publisher.put(name, src)
                return await client.get(name, dest, only_from=[holder])
            finally:
                publisher.close()
                client.close()

        report = asyncio.run(get("model", tmp_path / "dst", "closed"))  # every bulk connection refused
        assert report.bulk_bytes == 0 and report.peers == {"closed": size} and report.done_bytes == size
        assert same_tree(src, tmp_path / "dst")
        log = (tmp_path / "nodes" / "n3.log").read_text()
        assert log.count("takes no connection") == 1, log  # said once for that holder
        assert " lost (" not in log, log  # no chunk counted as lost: asked again over ZeroMQ

        report = asyncio.run(get("other", tmp_path / "dst2", "fixed"))
        assert report.bulk_bytes == size and report.peers == {"fixed": size}
        assert same_tree(src, tmp_path / "dst2")
        socket.create_connection(("127.0.0.1", port), 5).close()  # the configured port is the one listened on


UNAVAILABLE = unavailable_reason()


@pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)
def test_a_fetch_between_namespaces_without_curve_goes_over_the_bulk_port(tmp_path):
    from mooncake.testing.p2p_hosts import P2PHosts
    from test_p2p_hosts import sha256, write_random

    size = 40 * 1000 * 1000
    write_random(tmp_path / "src" / "blob.bin", size)
    with P2PHosts(tmp_path / "hosts", n=2, curve=False) as net:
        r = net.cli(1, "put", "blob", str(tmp_path / "src"))
        assert r.returncode == 0, r.stderr

        async def get() -> object:
            client = net.client(2)
            try:
                return await client.get("blob", tmp_path / "dst")
            finally:
                client.close()

        report = asyncio.run(get())
    assert report.bulk_bytes == size and report.peers == {"host1": size}
    assert sha256(tmp_path / "dst" / "blob.bin") == sha256(tmp_path / "src" / "blob.bin")
