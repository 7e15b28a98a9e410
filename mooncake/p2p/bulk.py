"""Chunk bytes on plain TCP connections beside the ZeroMQ control socket (clusters without CURVE):
the protocol, and the fetcher's side (the holder's: bulk_server.py).

Over ZeroMQ a chunk costs the holder a ``pread`` into memory, its xxh3 and libzmq's copy into
the socket, and the fetcher libzmq's copy into a 16 MiB message that BLAKE3 then reads back
from memory (BENCHMARKS.md section 18). Here the holder ``sendfile``s the chunk's byte range
from the object's file (no copy into the process), and the fetcher receives it 1 MiB at a
time into a reused buffer that is hashed and written while still in cache
(``LocalObject.write_slices``): the passes of a raw socket copy, plus BLAKE3 on cached data.

A connection sends a one-time token (``TOKEN_BYTES``, granted over the control channel) and
gets ``HEADER`` (the chunk's length) and the bytes; it then may send the next token, within
``IDLE_TIMEOUT_S`` (else the holder closes it; a fetcher reuses a connection idle at most half that).
The fetcher checks every chunk against its BLAKE3 digest (the manifest's), exactly as a
chunk received over ZeroMQ. A stream that ends early or stalls (a holder dead or its file
truncated) raises ``BulkLost``: the fetch asks another holder (mooncake/p2p/fetch.py). A bulk
port that takes no connection (refused, or silent past ``CONNECT_TIMEOUT_S``: a firewall that
opens only the ZeroMQ port) raises ``BulkUnreachable``: the fetch takes that holder's chunks
over ZeroMQ from then on.
Blocking I/O runs in threads, separate pools for sending and receiving so that a store that
serves and fetches at once never waits on itself. The same I/O on the event loop
(``loop.sock_sendfile``, ``sock_recv_into``) moved 1 GB no faster
(benchmarks/bench_p2p_bulk_io.py, BENCHMARKS.md section 18), and would hash and write on the
loop that answers the control socket.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from concurrent.futures import Executor
from typing import Iterator

from mooncake.p2p.objects import WRITE_SLICE, LocalObject
from mooncake.p2p.timing import CONNECT_TIMEOUT_S, IDLE_TIMEOUT_S

log = logging.getLogger(__name__)
TOKEN_BYTES = 16
HEADER = struct.Struct("!Q")  # the chunk's length, then its bytes


class BulkLost(Exception):
    """A bulk transfer that did not deliver its chunk: refused, cut off, or silent past the timeout."""


class BulkUnreachable(BulkLost):
    """The holder's bulk port takes no connection (refused, or silent: a firewall); nothing was sent."""


def set_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Blocking sends and receives that give up after ``timeout_s`` (EAGAIN)."""
    tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


class BulkPool:
    """A fetcher's connections to one holder's bulk port, reused from chunk to chunk (at most one
    per chunk in flight to that holder: the fetch's bound)."""

    def __init__(self, host: str, port: int, timeout_s: float = 20.0, source: str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, reuse_s: float = IDLE_TIMEOUT_S / 2) -> None:
        """``source``: the local address to connect from (tests); ``reuse_s``: a connection idle
        longer is closed, not reused (the holder may have closed it: ``IDLE_TIMEOUT_S``)."""
        self.host, self.port, self.timeout_s, self.source = host, port, timeout_s, source
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.reuse_s = reuse_s
        self._idle: list[tuple[socket.socket, float]] = []  # with when each became idle, oldest first
        self._busy: set[socket.socket] = set()
        self._lock = threading.Lock()  # fetches of several chunks share the pool, each in its thread
        self._closed = False

    def _checkout(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise BulkLost("the holder was dropped")
            fresh = time.monotonic() - self.reuse_s
            stale = [s for s, since in self._idle if since < fresh]
            self._idle = [(s, since) for s, since in self._idle if since >= fresh]
            sock = self._idle.pop()[0] if self._idle else None
        for s in stale:
            s.close()
        if sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), self.connect_timeout_s,
                                                (self.source, 0) if self.source else None)
            except OSError as e:  # refused, unreachable, or timed out (a firewall dropping it)
                raise BulkUnreachable(f"cannot connect to {self.host}:{self.port}: {e or 'timed out'}") from None
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_timeouts(sock, self.timeout_s)
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
                    self._idle.append((sock, time.monotonic()))
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
            idle, busy = [s for s, _ in self._idle], list(self._busy)
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
