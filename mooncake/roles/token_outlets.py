"""Decode's sockets to the frontends: each request's tokens go to the frontend that owns it
(``DecodeRequest.reply_to``), over one DEALER per frontend, created on first use (routing id:
this node's id, so the frontend knows which decode sent them). A send never waits: tokens for
a frontend that is gone (its queue full) are dropped and counted — the conductor has its
requests aborted once it is declared dead. Sockets no held request refers to are closed."""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.security import Curve
from mooncake.sockets import connect_client

log = logging.getLogger(__name__)


class TokenOutlets:
    def __init__(self, ctx: zmq.asyncio.Context, node_id: str, curve: Curve | None) -> None:
        self.ctx = ctx
        self.node_id = node_id
        self.curve = curve
        self.socks: dict[str, zmq.asyncio.Socket] = {}
        self.keys: dict[str, bytes | None] = {}  # endpoint -> the frontend key its socket expects
        self.dropped = 0  # token messages a gone frontend did not take

    def _sock(self, endpoint: str) -> zmq.asyncio.Socket:
        key = self.curve.vouched.get(endpoint) if self.curve is not None else None  # the key it ordered under
        sock = self.socks.get(endpoint)
        if sock is not None and self.keys.get(endpoint) != key:  # another frontend at that endpoint now
            self.socks.pop(endpoint).close(0)
            sock = None
        if sock is None:
            sock = self.socks[endpoint] = connect_client(self.ctx, zmq.DEALER, self.curve, "frontend", endpoint,
                                                         self.node_id, server_key=key)
            self.keys[endpoint] = key
        return sock

    async def send(self, endpoint: str, events: list[P.TokenEvent]) -> None:
        """One step's events for the requests of the frontend at ``endpoint``."""
        msg = events[0] if len(events) == 1 else P.TokenStep(events)
        try:
            await self._sock(endpoint).send_multipart(P.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not self.dropped:
                log.warning("the frontend at %s takes no tokens (gone?): dropping them", endpoint)
            self.dropped += 1

    def prune(self, in_use: set[str]) -> None:
        """Close the sockets of frontends no held request streams to."""
        for endpoint in [e for e in self.socks if e not in in_use]:
            self.socks.pop(endpoint).close(0)
            self.keys.pop(endpoint, None)

    def close(self) -> None:
        self.prune(set())
