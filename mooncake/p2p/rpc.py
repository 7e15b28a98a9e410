"""One request, one reply over a DEALER socket (to the conductor or to a store's P2P socket)."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from mooncake.protocol.p2p import Failure, P2PMsg, decoder, encoder
from mooncake.sockets import recv_multipart, send_multipart


class P2PError(RuntimeError):
    """A P2P request failed; the message is the reason to show the user."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.code = code


class Rpc:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, curve: object | None = None,
                 server_kind: str = "conductor", timeout_s: float = 10.0) -> None:
        """``curve``: a ``mooncake.security.Curve`` (this process's key) or None."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx, self._curve, self._server_kind = ctx, curve, server_kind
        self.sock = self._open()
        self._lock = asyncio.Lock()

    def _open(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.client(sock, self._server_kind)  # type: ignore[attr-defined]
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        """A new socket: the reply to an abandoned call (timed out, cancelled) must never answer the next."""
        self.sock.close(0)
        self.sock = self._open()

    async def call(self, msg: P2PMsg, timeout_s: float | None = None) -> P2PMsg:
        """The reply; a ``Failure`` reply raises P2PError, and so does silence past the timeout."""
        async with self._lock:
            try:
                await send_multipart(self.sock, [encoder.encode(msg)])
                frames = await asyncio.wait_for(recv_multipart(self.sock), timeout_s or self.timeout_s)
            except asyncio.TimeoutError:
                self._reset()
                raise P2PError(f"no answer from {self.endpoint} within {timeout_s or self.timeout_s:.0f}s",
                               "timeout") from None
            except asyncio.CancelledError:
                self._reset()  # its reply may still come
                raise
        try:
            reply = decoder.decode(frames[0].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise P2PError(f"malformed reply from {self.endpoint}: {e}") from None
        if isinstance(reply, Failure):
            raise P2PError(reply.message, reply.code)
        return reply

    def close(self) -> None:
        self.sock.close(0)
