"""A holder's bulk port: chunk bytes sent with ``sendfile`` on plain TCP connections beside the
ZeroMQ control socket (clusters without CURVE). The protocol and the fetcher's side: bulk.py.

Only what the control channel asked for is served: a ``ChunkGet`` with ``bulk`` set is
answered with a one-time token (128 random bits) naming that chunk, valid for
``GRANT_TTL_S``, once, and only from the address that asked. A connection sends a token and
gets ``HEADER`` (the chunk's length) and the bytes; it then may send the next token; an
unknown, expired, replayed or foreign token closes it. Never started under CURVE: a raw
socket would bypass its encryption and authentication (mooncake/p2p/service.py).

Bounds against a hostile or broken peer: a connection that brings no whole token within
``idle_timeout_s`` (``IDLE_TIMEOUT_S``) of connecting or of the end of its last chunk is closed;
at most ``max_connections`` (``MAX_CONNECTIONS``) are open, ``MAX_CONNECTIONS_PER_PEER`` from one
address, those over either cap closed at once; at most ``MAX_GRANTS`` tokens are outstanding,
``MAX_GRANTS_PER_PEER`` for one address, whose own oldest go first when it asks for more (one
peer's flood does not evict another's). An accept that fails (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
``ECONNABORTED``...) is waited out, ``ACCEPT_BACKOFF_S`` growing to ``ACCEPT_BACKOFF_MAX_S``: only
``close`` ends the accept loop. Refusals and failures are counted and logged at most every
``LOG_EVERY_S``, never line by line.

``sendfile`` of a whole chunk is one system call, in a thread of a pool of its own (a store
that serves and fetches at once never waits on itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from mooncake.p2p.bulk import HEADER, IDLE_TIMEOUT_S, TOKEN_BYTES, set_timeouts
from mooncake.p2p.objects import LocalObject, NotHeld
from mooncake.p2p.timing import GRANT_TTL_S

log = logging.getLogger(__name__)
MAX_GRANTS = 4096  # tokens outstanding at a holder; the oldest go first
MAX_CONNECTIONS = 1024  # bulk connections a holder has open (the default of ``max_connections``)
MAX_CONNECTIONS_PER_PEER = 128  # bulk connections a holder accepts from one address (2 x the most in flight)
MAX_GRANTS_PER_PEER = 2 * MAX_CONNECTIONS_PER_PEER  # tokens outstanding for one address; its own oldest go first
ACCEPT_BACKOFF_S, ACCEPT_BACKOFF_MAX_S = 0.1, 1.0  # the wait after a failed accept, doubling up to the most
LOG_EVERY_S = 10.0  # refusals and accept failures: counted, and logged at most this often
SENDERS = 8  # chunks a holder sends at once
# Fault injection for tests: this store cuts every bulk stream off halfway (a holder dying mid-stream).
CUT_ENV = "MOONCAKE_FAULT_P2P_BULK_CUT"
# Fault injection for tests: this store grants tokens but refuses every bulk connection (its port closed).
CLOSED_ENV = "MOONCAKE_FAULT_P2P_BULK_CLOSED"


@dataclass
class Grant:
    obj: LocalObject
    index: int
    peer: str  # the address that asked ("" if unknown)
    expires: float


class BulkServer:
    """A holder's bulk port: serves granted chunks with ``sendfile``."""

    def __init__(self, host: str, port: int = 0, timeout_s: float = 20.0, ttl_s: float = GRANT_TTL_S,
                 on_short: Callable[[LocalObject, int], None] | None = None, corrupt: bool = False,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> None:
        """``port``: 0 for any free one; ``timeout_s``: for sending a chunk; ``on_short(obj, index)``:
        called on the event loop when a chunk's file ended before the chunk did (truncated under the
        holder); ``corrupt``: fault injection, every chunk's first byte flipped on the way."""
        self.timeout_s, self.ttl_s, self.on_short = timeout_s, ttl_s, on_short
        self.idle_timeout_s, self.max_connections = idle_timeout_s, max_connections
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
        self._grants: dict[bytes, Grant] = {}  # insertion order: oldest first
        self._peer_grants: dict[str, dict[bytes, None]] = {}  # each address's tokens, oldest first
        self._per_peer: dict[str, int] = {}
        self._unlogged: Counter[str] = Counter()  # refusals and failures since the last log line
        self._log_at = 0.0
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
            self._take(next(iter(self._grants)))
        own = self._peer_grants.get(peer)
        if own is not None and len(own) >= MAX_GRANTS_PER_PEER:
            self._take(next(iter(own)))
            self._count(f"grant dropped: {MAX_GRANTS_PER_PEER} outstanding for one address")
        token = secrets.token_bytes(TOKEN_BYTES)
        self._grants[token] = Grant(obj, index, peer, now + self.ttl_s)
        self._peer_grants.setdefault(peer, {})[token] = None
        return token

    def _take(self, token: bytes) -> Grant | None:
        """Remove a token's grant (used, expired or dropped) and return it; None if there is none."""
        grant = self._grants.pop(token, None)
        if grant is not None:
            own = self._peer_grants[grant.peer]
            del own[token]
            if not own:
                del self._peer_grants[grant.peer]
        return grant

    def _count(self, what: str) -> None:
        """Count a refusal or failure (``what``: one of a few fixed texts); log the counts at most
        every ``LOG_EVERY_S``, so that a flood is not logged line by line."""
        self._unlogged[what] += 1
        now = time.monotonic()
        if now >= self._log_at:
            log.warning("p2p bulk: %s", ", ".join(f"{w} ({n}x)" for w, n in self._unlogged.items()))
            self._unlogged.clear()
            self._log_at = now + LOG_EVERY_S

    def _spawn(self, coro: object) -> None:
        task = asyncio.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        """Accept until ``close``: a connection over a cap is closed at once; a failed accept
        (out of file descriptors or memory, a connection aborted) is waited out."""
        loop = asyncio.get_running_loop()
        backoff = ACCEPT_BACKOFF_S
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listen)
            except OSError as e:
                self._count(f"accept failed: {e.strerror or e}")
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, ACCEPT_BACKOFF_MAX_S)
                continue
            backoff = ACCEPT_BACKOFF_S
            peer = addr[0]
            if len(self._conns) >= self.max_connections:
                self._count(f"connection refused: {self.max_connections} open")
                conn.close()
            elif self._per_peer.get(peer, 0) >= MAX_CONNECTIONS_PER_PEER:
                self._count(f"connection refused: {MAX_CONNECTIONS_PER_PEER} open from one address")
                conn.close()
            else:
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
                self._conns.add(conn)
                self._spawn(self._serve(conn, peer))

    async def _serve(self, conn: socket.socket, peer: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(conn, self.timeout_s)
            while True:
                try:
                    token = await self._recv_token(loop, conn)
                except TimeoutError:
                    self._count(f"connection closed: no token within {self.idle_timeout_s:g} s")
                    return
                if token is None:
                    return  # the fetcher closed it
                grant = self._take(token)
                if grant is None or grant.expires < time.monotonic() or (grant.peer and grant.peer != peer):
                    why = "unknown or used" if grant is None else "expired" if grant.expires < time.monotonic() \
                        else "granted to another address"
                    self._count(f"token refused: {why}")
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
        except OSError:
            return
        finally:
            self._conns.discard(conn)
            conn.close()
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]

    async def _recv_token(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes | None:
        """The next token, whole within ``idle_timeout_s`` (else TimeoutError); None if the
        connection ends first."""
        buf = bytearray(TOKEN_BYTES)
        got = 0
        async with asyncio.timeout(self.idle_timeout_s):
            while got < TOKEN_BYTES:
                n = await loop.sock_recv_into(conn, memoryview(buf)[got:])
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
        self._peer_grants.clear()
