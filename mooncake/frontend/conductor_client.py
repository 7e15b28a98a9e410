"""A frontend's conversation with the conductor that leads: placing attempts (``Submit`` ->
``Admitted`` / ``Refused``, asked again across a change of leader; a ``Submit`` stands in for a
heartbeat), reporting the prefills done and the attempts that ended here (``Release``, batched:
with the next ``Submit``, else on the next tick of ``REPORT_EVERY_S``, ``ticks.py``), the attempts
it drives when it registers with a conductor again (``Claims``: a new one adopts them), the
cluster as the conductor last described it (``ClusterView``: in answer to a heartbeat, and on
changes) and ``GET /cluster``'s snapshot (asked now). What else the conductor says
(``AttemptEnded``) goes to the frontend. A conductor that says nothing for ``LEADERLESS_AFTER_S``
or three heartbeats (it answers every heartbeat and every ``Submit``) is taken for none: ``ask``
then answers None at once, and the frontend places the attempt itself (``fallback.py``). What a
conductor of an older leadership term than the newest seen answers is refused (``term_fence.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec
import zmq.asyncio

from mooncake import protocol as P
from mooncake.config import Config
from mooncake.metrics import Metrics
from mooncake.roles.conductor_link import ConductorLink
from mooncake.security import Curve
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES
from mooncake.term_fence import TermFence
from mooncake.ticks import REPORT_EVERY_S, until_tick
from mooncake.tracing import current_traceparent, role_tracer, span
from mooncake.frontend.timing import RETRY_NO_WORKERS_S, LEADERLESS_AFTER_S

log = logging.getLogger(__name__)
CLAIMS_PER_MESSAGE = 256  # attempts per Claims message (each carries its prompt's block hashes)


class ConductorClient:
    def __init__(self, cfg: Config, node_id: str, on_message: Callable[[P.Msg], None],
                 metrics: Metrics | None = None) -> None:
        """``metrics``: where answers refused for a stale leader's term are counted (``term_fence.py``;
        None: they ride the heartbeats to the conductor)."""
        self.cfg = cfg
        self.fence = TermFence(node_id, metrics.stale_term_refused if metrics is not None else None)
        self.node_id = node_id
        self.on_message = on_message
        self.view = P.ClusterView("")  # the conductor's last word on the cluster
        self.link: Any = None  # a ConductorLink once connected (tests put a stand-in here)
        self.claims: Callable[[], list[P.Claim]] = list
        # a Submit may wait out an election: the lease's TTL, the watch noticing, the new leader's start
        c = cfg.coordination
        self.place_timeout_s = cfg.frontend.place_timeout_s + (c.lease_ttl_s + 2 * c.poll_s if c.etcd_endpoints else 0)
        self._placing: dict[str, tuple[P.Submit, asyncio.Future]] = {}  # wire id -> what awaits an answer
        self._admitted: set[str] = set()  # wire ids admitted here and not ended: an answer again is a repeat
        self._query: asyncio.Future | None = None
        self.ended: list[P.Ended] = []
        self.done_prefills: list[P.Prefilled] = []
        self._released_at = 0.0  # when the last Release went (wall clock: its ticks)
        self._reported = asyncio.Event()  # set by a report: the release loop sleeps while there is none
        self.registered_at = -float("inf")  # when this frontend last registered with a conductor again
        self.tracer = role_tracer(cfg.observability, "frontend")
        self.heard_at = time.monotonic()  # when the conductor last said anything
        self._tasks: list[asyncio.Task] = []

    async def connect(self, ctx: zmq.asyncio.Context, curve: Curve | None, register: P.Register,
                      load: Callable[[], P.Load], claims: Callable[[], list[P.Claim]]) -> None:
        """Register with the conductor (under etcd: the one that leads, followed when it changes);
        ``claims()``: the attempts this frontend drives, told to a conductor it registers with again."""
        self.claims = claims
        self.link = ConductorLink(ctx, self.cfg.conductor.endpoint, register, load, curve=curve,
                                  max_message_bytes=self.cfg.security.max_message_bytes or DEFAULT_MAX_MSG_BYTES,
                                  on_registered=self._resubmit, coordination=self.cfg.coordination, fence=self.fence)
        await self.link.connect(timeout_s=60)
        self.heard_at = time.monotonic()
        self.link.start_heartbeat()
        self._tasks += [asyncio.create_task(self._receive()), asyncio.create_task(self._release_loop())]

    async def close(self) -> None:
        await self.flush()
        for t in self._tasks:
            t.cancel()
        if self.link is not None:
            self.link.close()

    # ------------------------------------------------------------ placing and releasing

    @property
    def leaderless(self) -> bool:
        """No conductor has been heard from for ``LEADERLESS_AFTER_S`` or three heartbeats."""
        silent_s = max(LEADERLESS_AFTER_S, 3 * getattr(self.link, "heartbeat_s", 1.0))
        return time.monotonic() - self.heard_at > silent_s

    async def ask(self, msg: P.Submit) -> P.Admitted | P.Refused | None:
        """``_ask``, in a ``frontend.plan`` span when the request is traced (the conductor's spans are its children)."""
        if self.tracer is None or not msg.trace:
            return await self._ask(msg)
        with span(self.tracer, "frontend.plan", msg.trace, {"mooncake.request_id": msg.wire_id}) as s:
            answer = await self._ask(msgspec.structs.replace(msg, trace=current_traceparent()))
            s.set_attribute("mooncake.admitted", isinstance(answer, P.Admitted))
            return answer

    async def _ask(self, msg: P.Submit) -> P.Admitted | P.Refused | None:
        """The conductor's answer to ``msg`` (None: none within ``place_timeout_s``, or no
        conductor leads). A conductor this frontend has just registered with (a new leader, or a
        restart) that has no workers yet is asked again for up to ``dead_after_s`` after the
        registration: its workers are registering with it too. Otherwise "no workers" is the answer."""
        deadline = time.monotonic() + self.place_timeout_s
        try:
            while not self.leaderless:
                future = asyncio.get_running_loop().create_future()
                self._placing[msg.wire_id] = (msg, future)
                await self.flush()  # what waits to be released goes first, in the same wake-up of the conductor
                await self.link.send(msg.for_conductor(), beat=True)  # it carries the load, and is answered
                while not future.done() and not self.leaderless and time.monotonic() < deadline:
                    await asyncio.wait([future], timeout=min(RETRY_NO_WORKERS_S, max(0.01, deadline - time.monotonic())))
                if not future.done():
                    return None
                answer = future.result()
                now = time.monotonic()
                if not (isinstance(answer, P.Refused) and answer.reason == "no_workers" and now + RETRY_NO_WORKERS_S
                        < min(deadline, self.registered_at + self.cfg.liveness.dead_after_s)):
                    return answer
                await asyncio.sleep(RETRY_NO_WORKERS_S)
            return None
        finally:
            self._placing.pop(msg.wire_id, None)

    def release(self, ended: P.Ended) -> None:
        """An attempt that ended here: its booking is released with the next batch."""
        self._admitted.discard(ended.wire_id)
        self.ended.append(ended)
        self._reported.set()

    def prefilled(self, report: P.Prefilled) -> None:
        """An attempt's prefill is done (goes with the next batch, or before the next Submit, which
        may depend on it, as a fork placed by its prompt's blocks does)."""
        self.done_prefills.append(report)
        self._reported.set()

    async def flush(self) -> None:
        if (self.ended or self.done_prefills) and self.link is not None:
            msg = P.Release(self.node_id, self.ended, self.done_prefills)
            self.ended, self.done_prefills = [], []
            self._released_at = time.time()
            await self.link.send(msg)

    async def _release_loop(self) -> None:
        while True:
            await self._reported.wait()
            # on the tick the nodes' reports go on, one a tick (a timer may fire a little early)
            await asyncio.sleep(until_tick(REPORT_EVERY_S, self._released_at + REPORT_EVERY_S / 2 - time.time()))
            self._reported.clear()
            try:
                await self.flush()
            except Exception:
                log.exception("releasing ended attempts failed")

    async def _resubmit(self) -> None:
        """Registered with a conductor again (another leads, or it restarted): it hears the
        attempts this frontend drives (a new one adopts them), and what still waits for an answer
        is asked again (the other never answered, and may never; one sent after the Register is
        not answered twice: a conductor answers once per registration, and a repeat is ignored here)."""
        self.registered_at = self.heard_at = time.monotonic()
        claims = self.claims()
        for i in range(0, len(claims), CLAIMS_PER_MESSAGE):
            await self.link.send(P.Claims(self.node_id, claims[i:i + CLAIMS_PER_MESSAGE]))
        for msg, future in list(self._placing.values()):
            if future is None or not future.done():
                await self.link.send(msg.for_conductor())
        if self._query is not None and not self._query.done():
            await self.link.send(P.ClusterQuery(self.node_id))

    async def snapshot(self) -> dict:
        """``GET /cluster``: the conductor's snapshot, asked now (callers at the same time share
        the answer; one that never comes is asked for again by the next caller)."""
        query = self._query
        if query is None or query.done():
            query = self._query = asyncio.get_running_loop().create_future()
            await self.link.send(P.ClusterQuery(self.node_id))
        try:
            view = await asyncio.wait_for(asyncio.shield(query), self.cfg.frontend.place_timeout_s)
        except asyncio.TimeoutError:
            if self._query is query:
                self._query = None
            raise
        return view.snapshot

    # ------------------------------------------------------------ what the conductor says

    async def _receive(self) -> None:
        while True:
            msg, _ = await self.link.recv()
            self.heard_at = time.monotonic()
            try:
                self.handle(msg)
            except Exception:  # one bad message never stops the frontend
                log.exception("error handling %s", type(msg).__name__)

    def handle(self, msg: P.Msg) -> None:
        """One answer per attempt is acted on: a repeat of one (asked again on registering again)
        is ignored, an attempt admitted after this frontend gave up on it (or ended it) is released."""
        if isinstance(msg, (P.Admitted, P.Refused)):
            _, future = self._placing.get(msg.wire_id, (None, None))
            if future is not None and not future.done():
                future.set_result(msg)
                if isinstance(msg, P.Admitted):
                    self._admitted.add(msg.wire_id)
            elif msg.wire_id in self._admitted:  # driven here (or about to be): never aborted for a repeat
                log.debug("ignoring a repeated answer to %s", msg.wire_id)
            elif isinstance(msg, P.Admitted):  # placed after this frontend gave up on it
                self.release(P.Ended(msg.wire_id, abort=True))
        elif isinstance(msg, P.ClusterView):
            if msg.snapshot and self._query is not None and not self._query.done():
                self._query.set_result(msg)
            if msg.facts is None and self.view.facts is not None:  # a new leader, before its workers registered:
                msg = msgspec.structs.replace(msg, facts=self.view.facts)  # the model is still what it was
            if not msg.workers and self.view.workers:  # likewise: the workers last known (see fallback.py)
                msg = msgspec.structs.replace(msg, workers=self.view.workers)
            self.view = msg
        else:
            self.on_message(msg)
