"""Where decode instances stream a frontend's tokens: one ROUTER socket the frontend binds and
advertises (``tokens`` in its registration; each ``DecodeRequest`` carries it as ``reply_to``).
Decodes connect to it with their node id as routing id, so every message says which decode
sent it; a malformed one is dropped and logged. Under CURVE it takes worker keys only."""

from __future__ import annotations

import logging
from typing import Callable

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.security import Curve, allowed
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES, PlainSocket, bind_server

log = logging.getLogger(__name__)


class TokenInlet:
    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, curve: Curve | None,
                 on_tokens: Callable[[str, P.TokenEvent], None],
                 max_message_bytes: int = DEFAULT_MAX_MSG_BYTES) -> None:
        """``on_tokens(decode node id, event)`` for every token event that arrives (from ``start``)."""
        self.on_tokens = on_tokens
        self.curve = curve
        sock, self.endpoint = bind_server(ctx, zmq.ROUTER, curve, host, port, max_message_bytes, plain=True)
        self.sock = PlainSocket(sock, self._one)

    def start(self) -> None:
        self.sock.start()

    def _one(self, frames: list) -> None:
        sender = frames[0].bytes.decode(errors="replace")
        if not allowed(self.curve, frames[1], ("worker",)):
            log.warning("dropping tokens from %r: not a worker key", sender[:64])
            return
        try:
            msg, _ = P.decode(frames[1:])
        except P.ProtocolError as e:
            log.warning("dropping malformed message from %r: %s", sender[:64], e)
            return
        events = msg.events if isinstance(msg, P.TokenStep) else [msg] if isinstance(msg, P.TokenEvent) else []
        for event in events:  # one request's trouble never costs the others their tokens
            try:
                self.on_tokens(sender, event)
            except Exception:
                log.exception("error handling the tokens of %s from %s", event.req_id, sender)

    def close(self) -> None:
        self.sock.close()
