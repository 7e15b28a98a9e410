"""The conductor's socket: one ROUTER the roles' DEALERs connect to, and a table from
message type to handler.

Every received message is decoded (a malformed one is dropped and logged) and
handed to the handler registered for its type; a handler that raises is logged
and the loop goes on: no single message can stop the conductor. ``Register`` is
handled with the sender's routing id and, under CURVE, its peer key (``KIND:key``,
from the ZAP handler: membership authorizes the role by it); every other message
only when it comes from the node it names (others get ``Reregister`` on a
heartbeat, else nothing). Queries (``answer``: the P2P object index) are answered to any
sender, registered or not (under CURVE, any cluster key): the ``mooncake p2p`` command asks
them. Frames above ``max_message_bytes`` disconnect their sender.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.metrics import Metrics
from mooncake.sched.cluster import Cluster, Node
from mooncake.security import Curve, peer_of
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES, limit_message_size, recv_multipart, send_multipart

log = logging.getLogger(__name__)

Handler = Callable[[Node, P.Msg], None]


class Router:
    def __init__(self, endpoint: str, cluster: Cluster, curve: Curve | None,
                 on_register: Callable[[bytes, P.Register, str], P.Msg],
                 max_message_bytes: int = DEFAULT_MAX_MSG_BYTES, metrics: Metrics | None = None) -> None:
        """``on_register(routing id, message, peer key)`` answers a registration; ``metrics``: counts
        what arrives, by type."""
        self.counts = metrics.conductor_messages if metrics is not None else None
        self.cluster = cluster
        self.curve = curve
        self.on_register = on_register
        self.handlers: dict[type, Handler] = {}
        self.queries: dict[type, Callable[[P.Msg], P.Msg]] = {}
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        limit_message_size(self.sock, max_message_bytes)
        if curve is not None:
            curve.server(self.sock, self.ctx)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._pending: set[asyncio.Task] = set()

    def on(self, msg_type: type, handler: Handler) -> None:
        self.handlers[msg_type] = handler

    def answer(self, msg_type: type, handler: Callable[[P.Msg], P.Msg]) -> None:
        """Reply ``handler(msg)`` to whoever sends a ``msg_type``."""
        self.queries[msg_type] = handler

    async def serve(self) -> None:
        while True:
            frames = await recv_multipart(self.sock)
            try:
                await self._one(frames)
            except Exception:  # one bad message must never stop the conductor
                log.exception("error handling a message from %r", frames[0].bytes[:64] if frames else b"")

    async def _one(self, frames: list) -> None:
        ident = frames[0].bytes
        try:
            msg, _ = P.decode(frames[1:])
        except P.ProtocolError as e:
            log.warning("dropping malformed message from %r: %s", ident[:64], e)
            return
        if self.counts is not None:
            self.counts.labels(type(msg).__name__).inc()
        if isinstance(msg, P.Register):
            await self._send_raw(ident, self.on_register(ident, msg, peer_of(frames[1])))
            return
        query = self.queries.get(type(msg))
        if query is not None:
            await self._send_raw(ident, query(msg))
            return
        node_id = getattr(msg, "node_id", None) or ident.decode(errors="replace")
        node = self.cluster.get(node_id) if isinstance(node_id, str) else None
        if node is None or node.ident != ident:
            if isinstance(msg, P.Heartbeat):
                await self._send_raw(ident, P.Reregister())
            return
        node.last_seen = time.monotonic()
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from %s", type(msg).__name__, node.node_id)
            return
        handler(node, msg)

    def send(self, node_id: str, msg: P.Msg) -> None:
        """Queue ``msg`` to the current registration of ``node_id`` (nothing if it is gone)."""
        node = self.cluster.get(node_id)
        if node is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_raw(node.ident, msg))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_raw(self, ident: bytes, msg: P.Msg) -> None:
        await send_multipart(self.sock, [ident, *P.encode(msg)])

    async def flush(self, timeout_s: float = 1.0) -> None:
        """Wait for queued sends (at shutdown: LINGER is 0)."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

    def close(self) -> None:
        self.sock.close(0)
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
