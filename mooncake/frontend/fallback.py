"""Placing attempts without a conductor: what a frontend does while none leads (an election,
etcd unreachable, every conductor down), so that requests are served instead of failed.

It places over the workers the conductor last described (``ClusterView.workers``): the
prefill chosen by prefix affinity (rendezvous hashing of the prompt's first block, so one
system prompt keeps landing where its KV is) unless that instance holds ``AFFINITY_SLACK``
more of this frontend's attempts than the least loaded one; the decode with the fewest of
them. It then drives the attempt as the conductor would, over each worker's ``orders``
socket (``roles/orders.py``)::

    DecodeRequest ─▶ decode ─Reserved─▶ PrefillRequest ─▶ prefill ─PrefillDone─▶ FirstToken ─▶ decode

and hands the frontend the same ``Started`` / ``AttemptEnded`` a conductor would. No store is
read or written for these attempts (the prefill reuses its own device cache), and no cluster
limit is checked beyond the context length: the point is to keep serving until a conductor
leads again, when new attempts go to it and these run to their end here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.security import Curve
from mooncake.sockets import limit_message_size, recv_multipart

log = logging.getLogger(__name__)
AFFINITY_SLACK = 2  # attempts more than the least loaded prefill that prefix affinity may cost


@dataclass(eq=False)
class FallbackAttempt:
    submit: P.Submit
    prefill: str  # node ids
    decode: str
    prefill_request: P.PrefillRequest | None  # sent once decode has reserved

    @property
    def nodes(self) -> tuple[str, str]:
        return self.prefill, self.decode


class FallbackRouter:
    def __init__(self, ctx: zmq.asyncio.Context, curve: Curve | None, node_id: str, reply_to: str,
                 max_message_bytes: int, on_message: Callable[[P.Msg], None]) -> None:
        """``reply_to``: this frontend's token endpoint; ``on_message``: where ``Started`` and
        ``AttemptEnded`` go (the frontend's handler of the conductor's messages)."""
        self.ctx = ctx
        self.curve = curve
        self.node_id = node_id
        self.reply_to = reply_to
        self.max_message_bytes = max_message_bytes
        self.on_message = on_message
        self.workers: dict[str, P.WorkerRef] = {}  # the last known, by node id
        self.attempts: dict[str, FallbackAttempt] = {}  # wire id -> a live attempt placed here
        self.in_flight: Counter[str] = Counter()  # node id -> this frontend's attempts on it
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def can_place(self, workers: list[P.WorkerRef]) -> bool:
        """Whether ``workers`` (the conductor's last word on them) have a prefill and a decode;
        they are the ones placed over from now on."""
        self.workers = {w.node_id: w for w in workers}
        roles = {w.role for w in self.workers.values()}
        return {"prefill", "decode"} <= roles

    # ------------------------------------------------------------ placing

    def place(self, msg: P.Submit, max_model_len: int) -> P.Admitted | P.Refused:
        """Place ``msg``'s attempt and ask its decode to reserve (the rest follows the replies)."""
        if not self.can_place(list(self.workers.values())):
            return P.Refused(msg.wire_id, 503, "no_conductor", "no conductor leads and no worker is known", "", 1.0)
        prefill, decode = self._choose(msg)
        if msg.num_generated == 0:  # what the context leaves, as the conductor clamps it
            msg.sampling.max_tokens = max(1, min(msg.sampling.max_tokens, max_model_len - len(msg.tokens)))
        kv_token = secrets.token_bytes(16)
        prefill_request = P.PrefillRequest(msg.wire_id, msg.tokens, msg.hashes, msg.root, msg.sampling,
                                           decode.kv, num_generated=msg.num_generated, kv_token=kv_token)
        reserve = P.DecodeRequest(msg.wire_id, msg.tokens, msg.hashes, msg.root, msg.sampling,
                                  num_generated=msg.num_generated, kv_token=kv_token, reply_to=self.reply_to)
        self.attempts[msg.wire_id] = FallbackAttempt(msg, prefill.node_id, decode.node_id, prefill_request)
        self.in_flight.update((prefill.node_id, decode.node_id))
        self._send(decode.node_id, reserve)
        return P.Admitted(msg.wire_id, decode.node_id, prefill.node_id, msg.sampling.max_tokens)

    def _choose(self, msg: P.Submit) -> tuple[P.WorkerRef, P.WorkerRef]:
        prefills = [w for w in self.workers.values() if w.role == "prefill"]
        decodes = [w for w in self.workers.values() if w.role == "decode"]
        key = msg.hashes[0] if msg.hashes else msg.root
        least = min(self.in_flight[w.node_id] for w in prefills)
        near = [w for w in prefills if self.in_flight[w.node_id] <= least + AFFINITY_SLACK]
        prefill = max(near, key=lambda w: zlib.crc32(key + w.node_id.encode()))
        decode = min(decodes, key=lambda w: (self.in_flight[w.node_id], w.node_id))
        return prefill, decode

    def release(self, ended: P.Ended) -> bool:
        """An attempt that ended at the frontend; False if it was not placed here."""
        a = self._forget(ended.wire_id)
        if a is None:
            return False
        if ended.abort:
            for node_id in a.nodes:
                self._send(node_id, P.Abort(a.submit.wire_id))
        return True

    def _forget(self, wire_id: str) -> FallbackAttempt | None:
        a = self.attempts.pop(wire_id, None)
        if a is not None:
            self.in_flight.subtract(a.nodes)
            self.in_flight += Counter()  # drop the zeros
        return a

    # ------------------------------------------------------------ what the workers report

    def handle(self, node_id: str, msg: P.Msg) -> None:
        a = self.attempts.get(getattr(msg, "req_id", ""))
        if a is None or node_id not in a.nodes:
            return
        if isinstance(msg, P.Reserved) and node_id == a.decode and a.prefill_request is not None:
            prefill_request, a.prefill_request = a.prefill_request, None
            self._send(a.prefill, prefill_request)
        elif isinstance(msg, P.PrefillDone) and node_id == a.prefill:
            self.on_message(P.Started(msg.req_id, msg.first_token, msg.cached_tokens, msg.prefill_s, msg.fetch_s,
                                      msg.finished, msg.logprob))
            if msg.finished is not None:  # done at its first token: the decode drops its reservation
                self.release(P.Ended(msg.req_id, abort=True))
            else:
                self._send(a.decode, P.FirstToken(msg.req_id, msg.first_token))
        elif isinstance(msg, P.Failed):
            self.release(P.Ended(msg.req_id, abort=True))
            fatal = msg.kind is P.FailureKind.FATAL
            self.on_message(P.AttemptEnded(msg.req_id, msg.kind.value, msg.message, 400 if fatal else 503, msg.param))

    # ------------------------------------------------------------ sockets

    def _send(self, node_id: str, msg: P.Msg) -> None:
        sock = self._sock(node_id)
        if sock is None:
            log.warning("no orders endpoint known for %s: %s dropped", node_id, type(msg).__name__)
            return
        future = sock.send_multipart(P.encode(msg), flags=zmq.NOBLOCK)
        future.add_done_callback(lambda f: f.exception() and log.warning(
            "could not send %s to %s: %s", type(msg).__name__, node_id, f.exception()))

    def _sock(self, node_id: str) -> zmq.asyncio.Socket | None:
        sock = self._socks.get(node_id)
        worker = self.workers.get(node_id)
        if sock is None and worker is not None and worker.orders:
            sock = self._socks[node_id] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, self.node_id.encode())
            limit_message_size(sock, self.max_message_bytes)
            if self.curve is not None:
                self.curve.client(sock, "worker")
            sock.connect(worker.orders)
            self._tasks[node_id] = asyncio.create_task(self._receive(node_id, sock))
        return sock

    async def _receive(self, node_id: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await recv_multipart(sock)
            try:
                msg, _ = P.decode(frames)
                self.handle(node_id, msg)
            except P.ProtocolError as e:
                log.warning("dropping a malformed message from %s: %s", node_id, e)
            except Exception:  # one bad message never stops the frontend
                log.exception("error handling a message from %s", node_id)

    def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
