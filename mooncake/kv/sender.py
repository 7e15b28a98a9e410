"""One prefill attempt's KV on its way to the decode instance: messages leave in the order they
were queued, off the compute path (the engine thread queues layers while it computes; the event
loop ships them). ``pending_bytes`` is what is queued and not yet handed to the socket."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import torch

from mooncake import protocol as P
from mooncake.kv.layers import split_runs

ShipFn = Callable[[P.Msg, list[torch.Tensor]], Awaitable[None]]


class KVSender:
    def __init__(self, ship: ShipFn) -> None:
        self._ship = ship
        self._queue: asyncio.Queue[tuple[P.Msg, list[torch.Tensor]] | None] = asyncio.Queue()
        self.pending_bytes = 0
        self.sent_bytes = 0
        self._task = asyncio.create_task(self._run())

    def put(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        """Queue a message (event loop thread; from another thread use ``loop.call_soon_threadsafe``)."""
        self.pending_bytes += sum(t.nbytes for t in tensors)
        self._queue.put_nowait((msg, tensors))

    def put_blocks(self, req: P.PrefillRequest, first: int, kv: torch.Tensor) -> None:
        """Queue ``req``'s whole blocks ``[first, first + len(kv))`` as one ``KVTransfer``."""
        self.put(P.KVTransfer(req.req_id, first, token=req.kv_token), list(kv.unbind(0)))

    def put_layer(self, req: P.PrefillRequest, layer: int, first: int, kv: torch.Tensor, per_frame: int,
                  loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queue one layer of ``req``'s blocks from ``first`` as ``KVLayer`` messages of at most
        ``per_frame`` blocks (well under the receiver's message limit). From the engine thread, pass
        the event ``loop``: each message is queued there."""
        for start, part in split_runs(first, kv, per_frame):
            msg = P.KVLayer(req.req_id, start, layer, token=req.kv_token)
            if loop is None:
                self.put(msg, [part])
            else:
                loop.call_soon_threadsafe(self.put, msg, [part])

    def check(self) -> None:
        """Raise what stopped the sender early (a send that timed out, an abort)."""
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]

    async def finish(self) -> None:
        """Wait until everything queued has been handed to the socket; raise what stopped it."""
        self._queue.put_nowait(None)
        await self._task

    def cancel(self) -> None:
        if self._task.done():
            if not self._task.cancelled():
                self._task.exception()  # retrieved: the caller has seen it, or no longer cares
        else:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            msg, tensors = item
            await self._ship(msg, tensors)
            n = sum(t.nbytes for t in tensors)
            self.pending_bytes -= n
            self.sent_bytes += n
