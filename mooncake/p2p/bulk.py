"""Chunk bytes on plain TCP connections beside the ZeroMQ control socket (clusters without CURVE).

Over ZeroMQ a chunk costs the holder a ``pread`` into memory, its xxh3 and libzmq's copy into
the socket, and the fetcher libzmq's copy into a 16 MiB message that BLAKE3 then reads back
from memory (BENCHMARKS.md section 14). Here the holder ``sendfile``s the chunk's byte range
from the object's file (no copy into the process), and the fetcher receives it 1 MiB at a
time into a reused buffer that is hashed and written while still in cache
(``LocalObject.write_slices``): the passes of a raw socket copy, plus BLAKE3 on cached data.

Only what the control channel asked for is served: a ``ChunkGet`` with ``bulk`` set is
answered with a one-time token (128 random bits) naming that chunk, valid for
``GRANT_TTL_S``, once, and only from the address that asked. A connection sends a token and
gets ``HEADER`` (the chunk's length) and the bytes; it then may send the next token; an
unknown, expired, replayed or foreign token closes it. Never started under CURVE: a raw
socket would bypass its encryption and authentication (mooncake/p2p/service.py).

The fetcher checks every chunk against its BLAKE3 digest (the manifest's), exactly as a
chunk received over ZeroMQ. A stream that ends early or stalls (a holder dead or its file
truncated) raises ``BulkLost``: the fetch asks another holder (mooncake/p2p/fetch.py). A bulk
port that takes no connection (refused, or silent past ``CONNECT_TIMEOUT_S``: a firewall that
opens only the ZeroMQ port) raises ``BulkUnreachable``: the fetch takes that holder's chunks
over ZeroMQ from then on.
Blocking I/O runs in threads (``sendfile`` of a whole chunk is one system call), separate
pools for sending and receiving so that a store that serves and fetches at once never
waits on itself. The same I/O on the event loop (``loop.sock_sendfile``, ``sock_recv_into``)
moved 1 GB no faster (benchmarks/bench_p2p_bulk_io.py, BENCHMARKS.md section 14), and would
hash and write on the loop that answers the control socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

from mooncake.p2p.objects import WRITE_SLICE, LocalObject, NotHeld

log = logging.getLogger(__name__)
TOKEN_BYTES = 16
HEADER = struct.Struct("!Q")  # the chunk's length, then its bytes
GRANT_TTL_S = 30.0
MAX_GRANTS = 4096  # tokens outstanding at a holder; the oldest go first
MAX_CONNECTIONS_PER_PEER = 128  # bulk connections a holder accepts from one address (2 x the most in flight)
SENDERS = 8  # chunks a holder sends at once
CONNECT_TIMEOUT_S = 5.0  # a bulk port silent this long is taken as firewalled (a LAN connects in ms)
# Fault injection for tests: this store cuts every bulk stream off halfway (a holder dying mid-stream).
CUT_ENV = "MOONCAKE_FAULT_P2P_BULK_CUT"
# Fault injection for tests: this store grants tokens but refuses every bulk connection (its port closed).
CLOSED_ENV = "MOONCAKE_FAULT_P2P_BULK_CLOSED"


class BulkLost(Exception):
    """A bulk transfer that did not deliver its chunk: refused, cut off, or silent past the timeout."""


class BulkUnreachable(BulkLost):
    """The holder's bulk port takes no connection (refused, or silent: a firewall); nothing was sent."""


def _timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Blocking sends and receives that give up after ``timeout_s`` (EAGAIN)."""
    tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


@dataclass
class Grant:
    obj: LocalObject
    index: int
    peer: str  # the address that asked ("" if unknown)
    expires: float


class BulkServer:
    """A holder's bulk port: serves granted chunks with ``sendfile``."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 20.0, ttl_s: float = GRANT_TTL_S,
                 on_short: Callable[[LocalObject, int], None] | None = None, corrupt: bool = False) -> None:
        """``port``: 0 for any free one; ``on_short(obj, index)``: called on the event loop when a
        chunk's file ended before the chunk did (truncated under the holder); ``corrupt``: fault
        injection, every chunk's first byte flipped on the way."""
        self.timeout_s, self.ttl_s, self.on_short = timeout_s, ttl_s, on_short
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listen.bind((host, port))
        except OSError as e:
            self._listen.close()
            raise OSError(e.errno, f"cannot listen on the P2P bulk port {host}:{port} "
                                   f"([node] p2p_bulk_port): {e.strerror}") from None
        self._listen.listen(64)
        self._listen.setblocking(False)
        self.port: int = self._listen.getsockname()[1]
        self._grants: dict[bytes, Grant] = {}
        self._per_peer: dict[str, int] = {}
        self._conns: set[socket.socket] = set()
        self._tasks: set[asyncio.Task] = set()
        self._senders = ThreadPoolExecutor(SENDERS, thread_name_prefix="p2p-bulk-send")
        self._cut = os.environ.get(CUT_ENV) == "1"
        self._corrupt = corrupt
        self._closed_port = os.environ.get(CLOSED_ENV) == "1"

    def start(self) -> None:
        if self._closed_port:
            self._listen.close()  # connections to the advertised port are refused
            return
        self._spawn(self._accept())

    def grant(self, obj: LocalObject, index: int, peer: str = "") -> bytes:
        """A one-time token for chunk ``index`` of ``obj``, to be presented from address ``peer``."""
        now = time.monotonic()
        while self._grants and (len(self._grants) >= MAX_GRANTS or next(iter(self._grants.values())).expires < now):
            del self._grants[next(iter(self._grants))]  # insertion order: oldest first
        token = secrets.token_bytes(TOKEN_BYTES)
        self._grants[token] = Grant(obj, index, peer, now + self.ttl_s)
        return token

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, addr = await loop.sock_accept(self._listen)
            if self._per_peer.get(addr[0], 0) >= MAX_CONNECTIONS_PER_PEER:
                log.warning("p2p bulk: refusing a connection from %s (%d open)", addr[0], MAX_CONNECTIONS_PER_PEER)
                conn.close()
                continue
            self._per_peer[addr[0]] = self._per_peer.get(addr[0], 0) + 1
            self._conns.add(conn)
            self._spawn(self._serve(conn, addr[0]))

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _timeouts(conn, self.timeout_s)
        try:
            while True:
                token = await self._recv_token(loop, conn)
                if token is None:
                    return  # the fetcher closed it
                grant = self._grants.pop(token, None)
                if grant is None or grant.expires < time.monotonic() or (grant.peer and grant.peer != peer):
                    why = "unknown or used" if grant is None else "expired" if grant.expires < time.monotonic() \
                        else f"granted to {grant.peer}"
                    log.warning("p2p bulk: refusing a token from %s (%s)", peer, why)
                    return
                conn.setblocking(True)
                sending = loop.run_in_executor(self._senders, self._send, conn, grant)
                try:
                    result = await asyncio.shield(sending)
                except asyncio.CancelledError:  # closing: the socket is shut down; let the thread leave it
                    await asyncio.wait([sending])
                    raise
                conn.setblocking(False)
                if result == "short" and self.on_short is not None:
                    self.on_short(grant.obj, grant.index)
                if result != "sent":
                    return
        except (OSError, asyncio.TimeoutError):
            return
        finally:
            self._conns.discard(conn)
            conn.close()
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]

    async def _recv_token(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes | None:
        """The next token; None if the connection ends between tokens (or stays idle past the timeout)."""
        buf = bytearray(TOKEN_BYTES)
        got = 0
        while got < TOKEN_BYTES:
            n = await asyncio.wait_for(loop.sock_recv_into(conn, memoryview(buf)[got:]),
                                       None if got == 0 else self.timeout_s)
            if n == 0:
                return None
            got += n
        return bytes(buf)

    def _send(self, conn: socket.socket, grant: Grant) -> str:
        """In a thread: the chunk's length, then its bytes. "sent", "short" (its file ended
        first), "not held" (dropped since the grant), or an OSError (the fetcher went away)."""
        try:
            with grant.obj.span_fd(grant.index) as (fd, span):
                conn.sendall(HEADER.pack(span.length))
                length = span.length // 2 if self._cut else span.length
                sent = 0
                if self._corrupt and length:
                    conn.sendall(bytes([os.pread(fd, 1, span.offset)[0] ^ 0xFF]))
                    sent = 1
                while sent < length:
                    n = os.sendfile(conn.fileno(), fd, span.offset + sent, length - sent)
                    if n == 0:
                        log.error("p2p bulk: %s ends inside chunk %d", grant.obj.path(span.file), grant.index)
                        return "short"
                    sent += n
                return "sent" if not self._cut else "cut"
        except NotHeld:
            return "not held"

    async def close(self) -> None:
        tasks = list(self._tasks)
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a sender blocked in it
            except OSError:
                pass
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listen.close()
        self._senders.shutdown(wait=False, cancel_futures=True)
        self._grants.clear()


class BulkPool:
    """A fetcher's connections to one holder's bulk port, reused from chunk to chunk (at most one
    per chunk in flight to that holder: the fetch's bound)."""

    def __init__(self, host: str, port: int, timeout_s: float = 20.0, source: str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """``source``: the local address to connect from (tests)."""
        self.host, self.port, self.timeout_s, self.source = host, port, timeout_s, source
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self._idle: list[socket.socket] = []
        self._busy: set[socket.socket] = set()
        self._lock = threading.Lock()  # fetches of several chunks share the pool, each in its thread
        self._closed = False

    def _checkout(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise BulkLost("the holder was dropped")
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), self.connect_timeout_s,
                                                (self.source, 0) if self.source else None)
            except OSError as e:  # refused, unreachable, or timed out (a firewall dropping it)
                raise BulkUnreachable(f"cannot connect to {self.host}:{self.port}: {e or 'timed out'}") from None
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _timeouts(sock, self.timeout_s)
        with self._lock:
            self._busy.add(sock)
        return sock

    def fetch(self, token: bytes, obj: LocalObject, index: int, buf: bytearray | None = None) -> bool:
        """In a thread: receive granted chunk ``index`` of ``obj`` and write it (hashed slice by
        slice, ``buf`` reused between slices). True: it matches its digest; False: it does not
        (written, not to be counted); BulkLost: it did not arrive whole."""
        sock = self._checkout()
        keep = False
        try:
            try:
                sock.sendall(token)
                head = self._recv_exact(sock, HEADER.size)
            except OSError as e:
                raise BulkLost(f"refused or cut off before chunk {index}: {e}") from None
            length = HEADER.unpack(head)[0]
            if length != obj.spans[index].length:
                raise BulkLost(f"chunk {index} announced as {length} bytes, not {obj.spans[index].length}")
            ok = obj.write_slices(index, self._slices(sock, length, buf or bytearray(WRITE_SLICE)))
            keep = True
            return ok
        finally:
            with self._lock:
                self._busy.discard(sock)
                keep = keep and not self._closed
                if keep:
                    self._idle.append(sock)
            if not keep:
                sock.close()

    def _recv_exact(self, sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                raise BulkLost("the holder closed the connection (a token refused, or the holder gone)")
            got += k
        return bytes(buf)

    def _slices(self, sock: socket.socket, length: int, buf: bytearray) -> Iterator[memoryview]:
        view = memoryview(buf)
        left = length
        while left:
            want = min(left, len(buf))
            got = 0
            while got < want:
                try:
                    k = sock.recv_into(view[got:want], want - got)  # what is there (MSG_WAITALL: no faster)
                except OSError as e:  # reset, or EAGAIN after the receive timeout
                    raise BulkLost(f"cut off {length - left + got} bytes into a {length}-byte chunk: {e}") from None
                if k == 0:
                    raise BulkLost(f"cut off {length - left + got} bytes into a {length}-byte chunk")
                got += k
            left -= want
            yield view[:want]

    def close(self) -> None:
        """Close the idle connections and cut the busy ones (their threads end with BulkLost)."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for sock in idle:
            sock.close()
        for sock in busy:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class BulkLink:
    """A fetch's bulk path to one holder: a pool for the port its grants name, or, once that port
    took no connection, the reason its chunks go over ZeroMQ instead (``off``)."""

    def __init__(self, endpoint: str, timeout_s: float, label: str) -> None:
        """``endpoint``: the holder's ZeroMQ endpoint (its bulk port is on the same host);
        ``label``: what the log calls the holder."""
        self.host = endpoint.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        self.timeout_s, self.label = timeout_s, label
        self.pool: BulkPool | None = None
        self.off = ""  # "": bulk in use

    async def receive(self, executor: Executor, token: bytes, port: int, obj: LocalObject, index: int) -> bool:
        """Receive granted chunk ``index`` in a thread of ``executor`` and write it: True if it
        matches its digest, False if not (written, not to be counted); BulkLost if it did not
        arrive whole (BulkUnreachable: nothing sent, and this link is off from now on)."""
        if self.pool is None or self.pool.port != port:
            if self.pool is not None:
                self.pool.close()
            self.pool = BulkPool(self.host, port, self.timeout_s)
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, self.pool.fetch, token, obj, index)
        except BulkUnreachable as e:
            if not self.off:
                self.off = str(e)
                log.warning("p2p %s: %s's bulk port %s:%d takes no connection (%s); its chunks go over ZeroMQ "
                            "(slower; open [node] p2p_bulk_port on it)", obj.name, self.label, self.host, port, e)
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()  # transfers under way end with BulkLost
