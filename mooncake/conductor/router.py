"""The conductor's socket: one ROUTER the roles' DEALERs connect to, and a table from
message type to handler.

Every received message is decoded (a malformed one is dropped and logged) and
handed to the handler registered for its type; a handler that raises is logged
and the loop goes on: no single message can stop the conductor. ``Register`` is
handled with the sender's routing id and, under CURVE, its peer key (``KIND:key``,
from the ZAP handler: membership authorizes the role by it); every other message
only when it comes from the node it names. A sender the conductor does not know (it
restarted, or declared the node dead) is told ``Reregister`` in answer to a heartbeat or
to what stands in for one (a frontend's ``Submit``), once a second at most. Queries
(``answer``: the P2P object index) are answered to any sender, registered or not (under
CURVE, any cluster key): the ``mooncake p2p`` command asks them. Frames above ``max_message_bytes`` disconnect their sender.
What it sends carries the leader's term where the message has a field for it (fencing: ``term_fence.py``).
Each ``Admitted`` sent is logged at debug level with its term and wall time (who booked what, when).

The socket is a ``PlainSocket`` (read from the event loop's reader callback, written with
``NOBLOCK``; a ROUTER never blocks a send: a message to a peer that is gone or past its
high-water mark is dropped): pyzmq's asyncio socket costs several times more per message,
which bounded the conductor's plans per second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.metrics import Metrics
from mooncake.sched.node_registry import Cluster, Node
from mooncake.security import Curve, peer_of
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES, PlainSocket, limit_message_size

log = logging.getLogger(__name__)

Handler = Callable[[Node, P.Msg], None]


class Router:
    def __init__(self, endpoint: str, cluster: Cluster, curve: Curve | None,
                 on_register: Callable[[bytes, P.Register, str], P.Msg],
                 max_message_bytes: int = DEFAULT_MAX_MSG_BYTES, metrics: Metrics | None = None,
                 term: Callable[[], int] = lambda: 0) -> None:
        """``on_register(routing id, message, peer key)`` answers a registration; ``metrics``: counts
        what arrives, by type; ``term()``: the leader's term, which every message sent that has a
        ``term`` field carries (``term_fence.py``)."""
        self.term = term
        self.counts = metrics.conductor_messages if metrics is not None else None
        self.cluster = cluster
        self.curve = curve
        self.on_register = on_register
        self.handlers: dict[type, Handler] = {}
        self.queries: dict[type, Callable[[P.Msg, str], P.Msg]] = {}
        self.ctx = zmq.asyncio.Context()  # the CURVE authenticator's (asyncio) ...
        sock = zmq.Context.shadow(self.ctx.underlying).socket(zmq.ROUTER)  # ... and the socket's, one libzmq context
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        limit_message_size(sock, max_message_bytes)
        if curve is not None:
            curve.server(sock, self.ctx)
        sock.bind(endpoint)
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.sock = PlainSocket(sock, self._one)
        self._count_of: dict[type, Any] = {}  # message type -> its counter (a label lookup costs more than the count)
        self._reregister_at: dict[bytes, float] = {}  # unknown sender -> when it was last told to register
        self._closed = asyncio.Event()

    def on(self, msg_type: type, handler: Handler) -> None:
        self.handlers[msg_type] = handler

    def answer(self, msg_type: type, handler: Callable[[P.Msg, str], P.Msg]) -> None:
        """Reply ``handler(msg, sender's peer key)`` to whoever sends a ``msg_type``."""
        self.queries[msg_type] = handler

    async def serve(self) -> None:
        """Handle messages as they arrive, until closed or cancelled."""
        self.sock.start()
        try:
            await self._closed.wait()
        finally:
            self.sock.close()

    def _one(self, frames: list) -> None:
        ident = frames[0].bytes
        try:
            msg, _ = P.decode(frames[1:])
        except P.ProtocolError as e:
            log.warning("dropping malformed message from %r: %s", ident[:64], e)
            return
        if self.counts is not None:
            count = self._count_of.get(type(msg))
            if count is None:
                count = self._count_of[type(msg)] = self.counts.labels(type(msg).__name__)
            count.inc()
        if isinstance(msg, P.Register):
            self._send_raw(ident, self.on_register(ident, msg, peer_of(frames[1])))
            return
        query = self.queries.get(type(msg))
        if query is not None:
            self._send_raw(ident, query(msg, peer_of(frames[1])))
            return
        node_id = getattr(msg, "node_id", None) or P.node_of(ident)
        node = self.cluster.get(node_id) if isinstance(node_id, str) else None
        now = time.monotonic()
        if node is None or node.ident != ident or node.peer != peer_of(frames[1]):  # (another key: not that node)
            if isinstance(msg, (P.Heartbeat, P.Submit)) and now - self._reregister_at.get(ident, -1.0) >= 1.0:
                if len(self._reregister_at) > 4096:
                    self._reregister_at.clear()
                self._reregister_at[ident] = now
                self._send_raw(ident, P.Reregister())
            return
        node.last_seen = now
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from %s", type(msg).__name__, node.node_id)
            return
        handler(node, msg)

    def send(self, node_id: str, msg: P.Msg) -> None:
        """Queue ``msg`` to the current registration of ``node_id`` (nothing if it is gone)."""
        node = self.cluster.get(node_id)
        if node is not None:
            self._send_raw(node.ident, msg)

    def _send_raw(self, ident: bytes, msg: P.Msg) -> None:
        if self.sock.sock.closed:
            return
        term = self.term()
        if term and "term" in msg.__struct_fields__:  # an order of this leadership (a copy: the caller's stays)
            msg = msgspec.structs.replace(msg, term=term)
        try:
            self.sock.send([ident, *P.encode(msg)])
        except zmq.ZMQError as e:  # a ROUTER drops rather than blocks; anything else is logged
            log.warning("could not send %s: %s", type(msg).__name__, e)
        else:
            if type(msg) is P.Admitted:  # a booking, answered: per term, at debug level (tests/test_partition.py)
                log.debug("admitted %s under term %d at %.3f", msg.wire_id, term, time.time())

    async def flush(self, grace_s: float = 0.05) -> None:
        """Give libzmq's I/O thread a moment to pass on what was just sent (at shutdown: LINGER is 0)."""
        await asyncio.sleep(grace_s)

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()
