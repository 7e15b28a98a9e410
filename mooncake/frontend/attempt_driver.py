"""A frontend drives each attempt it owns along its route (the conductor's plan, or while no
conductor leads, the fallback's), over each worker's ``orders`` socket (``roles/orders.py``)::

    DecodeRequest ─▶ decode ─Reserved─▶ PrefillRequest ─▶ prefill(s) ─PrefillDone─▶ FirstToken ─▶ decode

The prefill's report goes to the frontend (``on_prefilled``: its first token, and for the
conductor what the prefill cost); a worker's ``Failed`` ends the attempt (``on_failed``; the
frontend aborts it on the other workers and moves or fails the request); a pipeline stage's
``StageDone`` is counted (``on_stage``). Messages of an attempt this driver no longer drives,
or from a worker not on its route, change nothing. One DEALER per worker, opened on first use.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.security import Curve
from mooncake.sockets import PlainSocket, connect_client
from mooncake.frontend.timing import CLOSE_LINGER_MS

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DrivenAttempt:
    submit: P.Submit
    route: P.Route
    started: float  # when this frontend started driving it
    prefills: list[tuple[str, P.PrefillRequest]] = field(default_factory=list)  # sent once decode has reserved
    reserved_at: float = 0.0
    prefilled: bool = False  # its prefill reported done
    claimed: bool = False  # told to a conductor (``claims``): it reports the attempt's prefill and end

    @property
    def booked(self) -> bool:
        """Whether a conductor books it (it placed it, or adopted it when claimed)."""
        return self.route.planned or self.claimed

    @property
    def wire_id(self) -> str:
        return self.submit.wire_id

    @property
    def last_prefill(self) -> str:
        """The prefill instance that reports ``PrefillDone`` (a group's last stage)."""
        return self.route.prefills[-1].node_id


class AttemptDriver:
    def __init__(self, ctx: zmq.asyncio.Context, curve: Curve | None, node_id: str, reply_to: str,
                 max_message_bytes: int, on_prefilled: Callable[[DrivenAttempt, P.PrefillDone, float], None],
                 on_failed: Callable[[DrivenAttempt, P.Failed], None],
                 on_stage: Callable[[P.StageDone], None] = lambda msg: None) -> None:
        """``reply_to``: this frontend's token endpoint (where decode streams the tokens);
        ``on_prefilled(attempt, report, when)``, ``on_failed(attempt, report)``: see above."""
        self.ctx = ctx
        self.curve = curve
        self.node_id = node_id
        self.identity = P.orders_identity(node_id, P.process_instance()).decode()  # what workers know this process by
        self.reply_to = reply_to
        self.max_message_bytes = max_message_bytes
        self.on_prefilled = on_prefilled
        self.on_failed = on_failed
        self.on_stage = on_stage
        self.attempts: dict[str, DrivenAttempt] = {}  # wire id -> an attempt being driven
        self._socks: dict[tuple[str, str], PlainSocket] = {}  # (node id, orders endpoint) -> its socket

    def drive(self, submit: P.Submit, route: P.Route) -> DrivenAttempt:
        """Start ``submit``'s attempt along ``route``: its decode reserves (the rest follows the replies)."""
        s, r, fallback = submit, route, not route.planned
        prefill = P.PrefillRequest(s.wire_id, s.tokens, s.hashes, s.root, s.sampling, r.decode.kv,
                                   num_generated=s.num_generated, fetch=r.fetch, store_endpoint=r.store_endpoint,
                                   kv_token=r.kv_token, fallback=fallback, store_range=r.store_range,
                                   trace=s.trace)
        a = self.attempts[s.wire_id] = DrivenAttempt(s, r, time.monotonic())
        a.prefills = [(w.node_id, msgspec.structs.replace(prefill, stage=stage) if r.stages else prefill)
                      for w, stage in zip(r.prefills, r.stages or [None] * len(r.prefills))]
        self._send(r.decode, P.DecodeRequest(s.wire_id, s.tokens, s.hashes, s.root, s.sampling,
                                             num_generated=s.num_generated,
                                             store_endpoint=r.store_endpoint if r.decode_writes else "",
                                             kv_token=r.kv_token, store_from_block=r.store_from_block,
                                             reply_to=self.reply_to, fallback=fallback,
                                             prefill_beside=r.prefill_beside, trace=s.trace))
        return a

    def end(self, wire_id: str, abort: bool) -> DrivenAttempt | None:
        """Stop driving an attempt (with ``abort``: its workers drop it); None if not driven here."""
        a = self.attempts.pop(wire_id, None)
        if a is not None and abort:
            self._abort(a, a.route.prefills + [a.route.decode])
        return a

    def claims(self) -> list[P.Claim]:
        """Every attempt driven here, as a conductor that has just started adopts them (from now
        on each is reported to the conductor, as one it placed is)."""
        for a in self.attempts.values():
            a.claimed = True
        return [P.Claim(a.submit.for_conductor(), a.route, a.prefilled) for a in self.attempts.values()]

    def load(self) -> Counter[str]:
        """node id -> the attempts this frontend drives on it."""
        return Counter(n for a in self.attempts.values() for n in a.route.node_ids)

    def _abort(self, a: DrivenAttempt, workers: list[P.WorkerRef]) -> None:
        for w in workers:
            self._send(w, P.Abort(a.wire_id))

    # ------------------------------------------------------------ what the workers report

    def handle(self, node_id: str, msg: P.Msg) -> None:
        a = self.attempts.get(getattr(msg, "req_id", ""))
        if a is None or node_id not in a.route.node_ids:
            return
        if isinstance(msg, P.Reserved) and node_id == a.route.decode.node_id and a.prefills:
            prefills, a.prefills, a.reserved_at = a.prefills, [], time.monotonic()
            by_id = {w.node_id: w for w in a.route.prefills}
            for stage_id, request in prefills:
                self._send(by_id[stage_id], request)
        elif isinstance(msg, P.PrefillDone) and node_id == a.last_prefill and a.reserved_at:
            if msg.finished is None:
                self._send(a.route.decode, P.FirstToken(msg.req_id, msg.first_token))
            else:  # done at its first token: the decode drops its reservation
                self._abort(a, [a.route.decode])
            a.prefilled = True
            self.on_prefilled(a, msg, time.monotonic())
        elif isinstance(msg, P.StageDone):
            self.on_stage(msg)
        elif isinstance(msg, P.Failed):
            self.on_failed(a, msg)

    # ------------------------------------------------------------ sockets

    def _send(self, worker: P.WorkerRef, msg: P.Msg) -> None:
        sock = self._sock(worker)
        if sock is None:
            log.warning("no orders endpoint known for %s: %s dropped", worker.node_id, type(msg).__name__)
            return
        try:
            sock.send(P.encode(msg))
        except zmq.ZMQError as e:  # its queue is full (it is gone or stuck): the attempt times out
            log.warning("could not send %s to %s: %s", type(msg).__name__, worker.node_id, e)

    def _sock(self, worker: P.WorkerRef) -> PlainSocket | None:
        key = (worker.node_id, worker.orders)
        sock = self._socks.get(key)
        if sock is None and worker.orders:
            for old in [k for k in self._socks if k[0] == worker.node_id]:  # it restarted elsewhere
                self._socks.pop(old).close()
            plain = connect_client(self.ctx, zmq.DEALER, self.curve, "worker", worker.orders, self.identity,
                                   self.max_message_bytes, plain=True)
            sock = self._socks[key] = PlainSocket(plain, lambda frames: self._one(worker.node_id, frames))
            sock.start()
        return sock

    def _one(self, node_id: str, frames: list) -> None:
        try:
            msg, _ = P.decode(frames)
        except P.ProtocolError as e:
            log.warning("dropping a malformed message from %s: %s", node_id, e)
            return
        self.handle(node_id, msg)

    def close(self) -> None:
        """Close the sockets (what was just sent, such as the aborts at shutdown, has
        ``CLOSE_LINGER_MS`` to go out)."""
        for sock in self._socks.values():
            sock.close(CLOSE_LINGER_MS)
        self._socks.clear()
