"""Where a worker takes its attempts: the frontends that own them order them here.

A prefill or decode instance binds one ROUTER (``orders`` in its registration; the conductor
puts it in every route it plans, and lists it in its ``ClusterView``). A frontend drives each
attempt it owns (``frontend/attempt_driver.py``) by sending here ``DecodeRequest``,
``PrefillRequest``, ``FirstToken`` and ``Abort``; whatever the worker reports of the attempt
(``Reserved``, ``PrefillDone``, ``StageDone``, ``Failed``) goes back to that frontend. The
conductor only aborts (over the worker's link), and when a frontend dies has the worker drop
every attempt that frontend ordered here. Attempts a frontend placed itself while no conductor
led (``fallback``) are marked so in the worker's registration: a conductor keeps them until
their frontend claims them (``conductor/adoption.py``), and drops them if it never does.
Under CURVE only frontend keys may order; the key a ``DecodeRequest`` came under is the one its
tokens go to (``Curve.vouch``: the frontend's token socket is bound under it).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import torch
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.security import Curve, allowed, peer_of
from mooncake.sockets import bind_server, recv_multipart

log = logging.getLogger(__name__)
ORDERS = (P.DecodeRequest, P.PrefillRequest, P.FirstToken, P.Abort)


class Orders:
    def __init__(self, ctx: zmq.asyncio.Context, host: str, curve: Curve | None, max_message_bytes: int,
                 node_id: str, handle: Callable[[P.Msg, list[torch.Tensor]], Awaitable[None]]) -> None:
        """``handle(msg, tensors)``: the worker's own handler of conductor messages."""
        self.node_id = node_id
        self.handle = handle
        self.curve = curve
        self.sock, self.endpoint = bind_server(ctx, zmq.ROUTER, curve, host, 0, max_message_bytes)
        self.ordered_by: dict[str, bytes] = {}  # wire id -> routing id of the frontend that ordered it
        self.fallback: set[str] = set()  # wire ids placed by their frontend while no conductor led
        self._unheld: set[str] = set()  # not held at the last prune

    async def serve(self, held: Callable[[], list[str]]) -> None:
        """Handle orders until cancelled; ``held()``: the wire ids the worker still holds (an
        attempt it no longer holds is forgotten here too)."""
        while True:
            frames = await recv_multipart(self.sock)
            ident = frames[0].bytes
            if not allowed(self.curve, frames[1], ("frontend",)):
                log.warning("dropping an order from %r: not a frontend key", ident[:64])
                continue
            try:
                msg, tensors = P.decode(frames[1:])
            except P.ProtocolError as e:
                log.warning("dropping a malformed order from %r: %s", ident[:64], e)
                continue
            if not isinstance(msg, ORDERS):
                log.warning("dropping %s from frontend %r: not an order", type(msg).__name__, ident[:64])
                continue
            if isinstance(msg, (P.DecodeRequest, P.PrefillRequest)):
                if len(self.ordered_by) > 64 + 2 * len(self.ordered_by.keys() & (keep := set(held()))):
                    self._prune(keep)
                self.ordered_by[msg.req_id] = ident
                if msg.fallback:
                    self.fallback.add(msg.req_id)
                if isinstance(msg, P.DecodeRequest) and self.curve is not None:
                    self.curve.vouch(msg.reply_to, peer_of(frames[1]))
            try:
                await self.handle(msg, tensors)
            except Exception as e:  # reported to the frontend, as the conductor's would be
                log.exception("error handling ordered %s %s", type(msg).__name__, msg.req_id)
                if not isinstance(msg, P.Abort):
                    await self.reply(P.Failed(msg.req_id, self.node_id, f"{type(e).__name__}: {e}"))

    def _prune(self, held: set[str]) -> None:
        """Forget the attempts the worker no longer holds at two prunes in a row (one it has
        just let go may still have a report on its way: a failure, a preemption)."""
        gone = {w for w in self.ordered_by if w not in held}
        drop = gone & self._unheld
        self.ordered_by = {w: i for w, i in self.ordered_by.items() if w not in drop}
        self.fallback -= drop
        self._unheld = gone - drop

    async def reply(self, msg: P.Msg) -> bool:
        """Send ``msg`` to the frontend that ordered its attempt; False if none did. A frontend
        that is gone loses it (a ROUTER never blocks)."""
        ident = self.ordered_by.get(getattr(msg, "req_id", None) or "")
        if ident is None:
            return False
        try:
            await self.sock.send_multipart([ident, *P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not report %s to its frontend: %s", type(msg).__name__, e)
        return True

    def placed_alone(self, wire_ids: list[str]) -> list[str]:
        """Those of ``wire_ids`` a frontend placed itself while no conductor led."""
        return [w for w in wire_ids if w in self.fallback]

    def ordered_by_frontend(self, gone: P.FrontendGone, wire_ids: list[str]) -> list[str]:
        """Those of ``wire_ids`` the frontend process that is ``gone`` ordered here."""
        ident = P.orders_identity(gone.node_id, gone.instance or str(gone.pid))
        return [w for w in wire_ids if self.ordered_by.get(w) == ident]

    def close(self) -> None:
        self.sock.close(0)
