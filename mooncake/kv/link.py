"""The prefill -> decode KV link: decode's PULL ingress and prefill's PUSH egress.

Under CURVE the ingress is a CURVE server (admitting the cluster's keys, tagging each
message with its sender's kind) and the egress presents the worker key. Receive with
``mooncake.sockets.recv_multipart``: a CURVE server socket wakes with nothing to read
while a peer's handshake completes, and a loop that lets that EAGAIN escape dies.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from mooncake.security import Curve
from mooncake.sockets import bind_server


def bind_kv_ingress(ctx: zmq.asyncio.Context, curve: Curve | None, host: str, port: int,
                    max_message_bytes: int) -> tuple[zmq.asyncio.Socket, str]:
    """Decode's KV socket, bound on ``host`` (``port`` 0: any free port); (socket, endpoint)."""
    return bind_server(ctx, zmq.PULL, curve, host, port, max_message_bytes)


def connect_kv_egress(ctx: zmq.asyncio.Context, curve: Curve | None, endpoint: str) -> zmq.asyncio.Socket:
    """A prefill's socket to one decode's KV ingress. IMMEDIATE: messages wait for a connection
    whose handshake completed instead of queueing on one that may never come up."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    if curve is not None:  # the ingress is a CURVE server with the worker key
        curve.client(sock, "worker")
    sock.connect(endpoint)
    return sock
