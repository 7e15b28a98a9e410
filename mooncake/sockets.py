"""Receiving and sending on asyncio ZeroMQ sockets without losing a loop to a spurious EAGAIN,
and the size limit every socket gets.

libzmq may report a socket readable (``ZMQ_EVENTS`` has ``POLLIN``) and then answer the
non-blocking receive with EAGAIN: it happens routinely on a CURVE server socket while a
peer's handshake completes (the ZAP exchange wakes the socket with nothing to read).
pyzmq's asyncio socket hands that EAGAIN to the awaiting coroutine as ``zmq.Again``. A
receive loop that lets it escape dies silently, and every later message is lost: that
was why the prefill -> decode KV link lost its first transfer under CURVE. These helpers
retry instead.
"""

from __future__ import annotations

from typing import Any, Sequence

import zmq
import zmq.asyncio

DEFAULT_MAX_MSG_BYTES = 64 << 20  # a socket's limit when the role does not know its block size


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


def bind_server(ctx: zmq.asyncio.Context, socket_type: int, curve: Any, host: str, port: int,
                max_bytes: int) -> tuple[zmq.asyncio.Socket, str]:
    """A socket peers connect to, bound on ``host`` (``port`` 0: any free port), a CURVE server
    when ``curve`` (a ``security.Curve``) is given; (socket, the endpoint it is bound at)."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    limit_message_size(sock, max_bytes)
    if curve is not None:
        curve.server(sock, ctx)
    sock.bind(f"tcp://{host}:{port}" if port else f"tcp://{host}:*")
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def connect_client(ctx: zmq.asyncio.Context, socket_type: int, curve: Any, server_kind: str, endpoint: str,
                   identity: str = "", max_bytes: int = 0) -> zmq.asyncio.Socket:
    """A socket connected to ``endpoint``; under CURVE it expects the server to hold the
    ``server_kind`` key. ``identity``: its routing id (what a ROUTER on the other end sees)."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if max_bytes:
        limit_message_size(sock, max_bytes)
    if curve is not None:
        curve.client(sock, server_kind)
    sock.connect(endpoint)
    return sock
