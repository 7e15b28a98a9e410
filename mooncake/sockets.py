"""Receiving and sending on asyncio ZeroMQ sockets without losing a loop to a spurious EAGAIN,
plain sockets read from the event loop's reader callback (``PlainSocket``), and the size limit
every socket gets.

libzmq may report a socket readable (``ZMQ_EVENTS`` has ``POLLIN``) and then answer the
non-blocking receive with EAGAIN: it happens routinely on a CURVE server socket while a
peer's handshake completes (the ZAP exchange wakes the socket with nothing to read).
pyzmq's asyncio socket hands that EAGAIN to the awaiting coroutine as ``zmq.Again``. A
receive loop that lets it escape dies silently, and every later message is lost: that
was why the prefill -> decode KV link lost its first transfer under CURVE. These helpers
retry instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)
DEFAULT_MAX_MSG_BYTES = 64 << 20  # a socket's limit when the role does not know its block size
MESSAGES_PER_WAKEUP = 256  # then other callbacks run before the rest is read
_send = zmq.backend.Socket.send  # a frame's send without pyzmq's Python wrapper (its flags are Python enums)
_recv = zmq.backend.Socket.recv  # likewise, a frame's receive
_get = zmq.backend.Socket.get
_NOBLOCK, _NOBLOCK_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


async def recv_multipart(sock: zmq.asyncio.Socket, copy: bool = False) -> list[Any]:
    """The next message; a spurious EAGAIN is retried, never raised."""
    while True:
        try:
            return await sock.recv_multipart(copy=copy)
        except zmq.Again:
            continue


async def send_multipart(sock: zmq.asyncio.Socket, frames: Sequence[Any], copy: bool = False) -> None:
    """Send ``frames``; a spurious EAGAIN is retried (nothing of the message went out then:
    libzmq queues a multipart message whole or not at all)."""
    while True:
        try:
            await sock.send_multipart(frames, copy=copy)
            return
        except zmq.Again:
            continue


def limit_message_size(sock: zmq.Socket, max_bytes: int) -> None:
    """Peers that send a larger message are disconnected by libzmq (``ZMQ_MAXMSGSIZE``: each
    frame is checked against it before it is buffered)."""
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes))


def _socket(ctx: zmq.asyncio.Context, socket_type: int, plain: bool) -> Any:
    return (zmq.Context.shadow(ctx.underlying) if plain else ctx).socket(socket_type)


def bind_server(ctx: zmq.asyncio.Context, socket_type: int, curve: Any, host: str, port: int,
                max_bytes: int, plain: bool = False) -> tuple[Any, str]:
    """A socket peers connect to, bound on ``host`` (``port`` 0: any free port), a CURVE server
    when ``curve`` (a ``security.Curve``) is given; (socket, the endpoint it is bound at).
    ``plain``: a blocking-API socket (for ``PlainSocket``) instead of an asyncio one."""
    sock = _socket(ctx, socket_type, plain)
    sock.setsockopt(zmq.LINGER, 0)
    limit_message_size(sock, max_bytes)
    if curve is not None:
        curve.server(sock, ctx)
    sock.bind(f"tcp://{host}:{port}" if port else f"tcp://{host}:*")
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def connect_client(ctx: zmq.asyncio.Context, socket_type: int, curve: Any, server_kind: str, endpoint: str,
                   identity: str = "", max_bytes: int = 0, plain: bool = False, server_key: bytes | None = None) -> Any:
    """A socket connected to ``endpoint``; under CURVE it expects the server to hold the
    ``server_kind`` key (``server_key``: that very key, where the kind has several). ``identity``:
    its routing id (what a ROUTER on the other end sees); ``plain``: as for ``bind_server``."""
    sock = _socket(ctx, socket_type, plain)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if max_bytes:
        limit_message_size(sock, max_bytes)
    if curve is not None:
        curve.client(sock, server_kind, server_key)
    sock.connect(endpoint)
    return sock


class PlainSocket:
    """A blocking-API ZeroMQ socket driven by the event loop: read from the loop's reader callback
    (every message waiting, ``MESSAGES_PER_WAKEUP`` at a time, each to ``on_frames``) and written
    with ``NOBLOCK``, so no message costs a task or a future. pyzmq's asyncio socket costs several
    times more per message. A send that would block fails at once (``zmq.Again``): a ROUTER drops
    instead, a DEALER with no peer or a full queue raises, and the caller says what is lost."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list[zmq.Frame]], None]) -> None:
        self.sock = sock
        self.on_frames = on_frames
        self._fd = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_soon = False

    def start(self) -> None:
        """Start reading (from the running loop), what arrived before included."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()

    def send(self, frames: Sequence[Any]) -> None:
        """Queue a message (its frames) now; raises ``zmq.ZMQError`` when it cannot."""
        try:
            for frame in frames[:-1]:
                _send(self.sock, frame, _NOBLOCK_MORE)
            _send(self.sock, frames[-1], _NOBLOCK)
        finally:  # a send, even one that fails, may consume the descriptor's edge: read what waits
            if not self._draining and self._loop is not None and not self.sock.closed \
                    and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._schedule_drain()

    def _drain(self) -> None:
        """The descriptor is edge-triggered: read until empty (or the budget, then come back).
        Frames are read one by one, as long as the socket says a message waits: pyzmq's
        ``recv_multipart`` and the ``zmq.Again`` that ends its loop cost more than the reading."""
        self._drain_soon = False
        sock = self.sock
        if sock.closed:
            return
        self._draining = True
        try:
            for _ in range(MESSAGES_PER_WAKEUP):
                if sock.closed or not _get(sock, _EVENTS) & _POLLIN:  # a handler closed it, or all is read
                    return
                try:
                    frame = _recv(sock, _NOBLOCK, False)
                except zmq.Again:  # what it announced was not a message (a CURVE handshake's frames)
                    return
                frames = [frame]
                while frame.more:
                    frame = _recv(sock, _NOBLOCK, False)
                    frames.append(frame)
                try:
                    self.on_frames(frames)
                except Exception:  # one bad message never stops the reader
                    log.exception("error handling a message")
            self._schedule_drain()
        finally:
            self._draining = False

    def _schedule_drain(self) -> None:
        if not self._drain_soon and self._loop is not None:
            self._drain_soon = True
            self._loop.call_soon(self._drain)

    def close(self, linger_ms: int = 0) -> None:
        if self.sock.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self.sock.close(linger_ms)
