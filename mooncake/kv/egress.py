"""A prefill's KV egress: one PUSH socket per decode instance, and the send of one KV message.

A send gives up when its request is aborted (e.g. the conductor found the decode dead and the
request moved) or after ``SEND_TIMEOUT_S``; then the socket is dropped, since its queue may hold
parts of that request. Every message carries the attempt's token and a checksum per frame (a
block, or a layer of blocks).
"""

from __future__ import annotations

import asyncio
from typing import Container

import torch
import zmq.asyncio

from mooncake import protocol as P
from mooncake.kv.integrity import checksums
from mooncake.kv.link import connect_kv_egress
from mooncake.security import Curve
from mooncake.sockets import send_multipart
from mooncake.kv.timing import SEND_TIMEOUT_S


class KVEgress:
    def __init__(self, ctx: zmq.asyncio.Context, curve: Curve | None, aborted: Container[str]) -> None:
        """``aborted``: the ids of requests whose sends stop (read at each send, not copied)."""
        self._ctx, self._curve, self._aborted = ctx, curve, aborted
        self._socks: dict[str, zmq.asyncio.Socket] = {}

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = connect_kv_egress(self._ctx, self._curve, endpoint)
            self._socks[endpoint] = sock
        return sock

    async def ship(self, endpoint: str, msg: P.KVTransfer | P.KVLayer | P.Activations,
                   tensors: list[torch.Tensor]) -> None:
        """Send one message with its frames' checksums (see the module docstring)."""
        msg.checksums = await asyncio.to_thread(checksums, tensors)
        frames = P.encode(msg, tensors)
        send = asyncio.ensure_future(send_multipart(self._socket(endpoint), frames))
        deadline = asyncio.get_running_loop().time() + SEND_TIMEOUT_S
        while not send.done():
            await asyncio.wait({send}, timeout=0.1)
            if not send.done() and (msg.req_id in self._aborted or asyncio.get_running_loop().time() > deadline):
                send.cancel()
                self._socks.pop(endpoint).close(0)  # its queue may hold parts of this request
                raise TimeoutError(f"KV to {endpoint} not accepted within {SEND_TIMEOUT_S:.0f}s"
                                   if msg.req_id not in self._aborted else "aborted")
        send.result()

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()
