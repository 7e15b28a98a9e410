"""A worker role's connection to the conductor: handshake, heartbeats, messages.

One DEALER socket. ``connect`` registers and waits for the conductor's answer
(with a timeout); a background task heartbeats with the role's current load and the blocks it
cached or dropped since (``block_events.py``: early when it has some), on the wall clock's ticks
that every node shares (``ticks.py``). A message sent as a ``beat`` stands in for a heartbeat (a
frontend's ``Submit``: it carries its load, and the conductor answers it), so a busy frontend
sends none. If
the conductor answers a heartbeat with ``Reregister`` (it restarted and lost its
state, or had declared this role dead) the link registers again and calls
``on_registered`` so that the role can re-announce what it holds (a store's blocks,
for instance). Every registration lists the requests the role holds (``holding``);
the conductor answers which of them it still knows there, and the role drops the
others (``on_orphans``): reconciliation, so that no reservation waits for a timeout.
What a conductor sends under an older leadership term than the newest the process has seen is
refused (``term_fence.py``: a stale leader is fenced off). A registration refused because its node
id is still held by a live process (under CURVE: the one this process replaces, not gone yet) is
retried until ``connect``'s timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.config import CoordinationConfig
from mooncake.coordination.election import LeaderWatch
from mooncake.roles.block_events import BlockEvents
from mooncake.security import Curve
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES, limit_message_size, recv_multipart, send_multipart
from mooncake.term_fence import TermFence
from mooncake.ticks import REPORT_EVERY_S, SLACK_S, last_tick, until_tick
from mooncake.roles.timing import TAKEN_RETRY_S

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class HandshakeError(RuntimeError):
    """The conductor did not answer the registration in time."""


class ConductorLink:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        register: P.Register,
        load: Callable[[], dict[str, Any]] = dict,
        on_registered: Callable[[], Awaitable[None]] | None = None,
        curve: Curve | None = None,
        max_message_bytes: int = DEFAULT_MAX_MSG_BYTES,
        holding: Callable[[], list[str]] = list,
        fallback: Callable[[list[str]], list[str]] = lambda held: [],
        on_orphans: Callable[[list[str]], Awaitable[None]] | None = None,
        coordination: CoordinationConfig | None = None,
        fence: TermFence | None = None,
    ) -> None:
        """With ``coordination`` (etcd endpoints set), ``endpoint`` is only the default: the link
        connects to the conductor etcd says leads, and follows it when another does. ``fence``: the
        process's newest leadership term (``term_fence.py``; a store shares its server's), which
        refuses what a stale conductor sends (its own when None)."""
        self.fence = fence if fence is not None else TermFence(register.node_id)
        self.endpoint = endpoint
        self.register_msg = register
        self.load = load
        self.on_registered = on_registered
        self.holding = holding
        self.fallback = fallback
        self.on_orphans = on_orphans
        self._held: list[str] = []  # what the last registration said this role holds
        self.heartbeat_s = 1.0
        self.beat_at = 0.0  # when the last heartbeat, or a message that stands in for one, went (wall clock)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, P.routing_id(register))
        limit_message_size(self.sock, max_message_bytes)
        if curve is not None:
            curve.client(self.sock, "conductor")
        self.watch = LeaderWatch(coordination, self.follow) if coordination and coordination.etcd_endpoints else None
        if self.watch is None:
            self.sock.connect(endpoint)
        self._send_lock = asyncio.Lock()
        self._reregistering = False
        self._connected = self.watch is None
        self._tasks: list[asyncio.Task] = []

    @property
    def node_id(self) -> str:
        return self.register_msg.node_id

    async def send(self, msg: P.Msg, tensors: list[torch.Tensor] | tuple = (), beat: bool = False) -> None:
        """``beat``: ``msg`` stands in for a heartbeat (the next is due ``heartbeat_s`` after it)."""
        frames = P.encode(msg, tensors)
        async with self._send_lock:
            await send_multipart(self.sock, frames)
        if beat:
            self.beat_at = time.time()

    async def follow(self, endpoint: str) -> None:
        """Another conductor leads (etcd says): talk to it, and register with it."""
        if endpoint == self.endpoint and self._connected:
            return
        if self._connected:
            self.sock.disconnect(self.endpoint)
        self.endpoint, self._connected = endpoint, True
        self.sock.connect(endpoint)
        self._reregistering = True
        await self._register()

    async def connect(self, timeout_s: float = 30.0) -> None:
        """Register, retrying until the conductor answers or ``timeout_s`` passes (under etcd,
        once a conductor leads: a cluster may start before its conductors)."""
        if self.watch is not None:
            self.endpoint, self._connected = await self.watch.first(), True
            self.sock.connect(self.endpoint)
            self._tasks.append(asyncio.create_task(self.watch.run()))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            await self._register()
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                frames = await asyncio.wait_for(recv_multipart(self.sock), min(2.0, max(remaining, 0.01)))
            except asyncio.TimeoutError:
                if asyncio.get_running_loop().time() >= deadline:
                    raise HandshakeError(f"conductor at {self.endpoint} did not answer within {timeout_s:.0f}s") from None
                continue
            msg, _ = P.decode(frames)
            if not self.fence.admit(msg):  # a stale conductor's answer: wait for the leader's
                continue
            if isinstance(msg, P.Registered):
                self.heartbeat_s = msg.heartbeat_s
                self._reconcile(msg)
                log.info("%s registered with conductor %s", self.node_id, self.endpoint)
                return
            if isinstance(msg, P.Error) and msg.code == "node_id_taken" and \
                    asyncio.get_running_loop().time() + TAKEN_RETRY_S < deadline:  # a restart: the old one goes soon
                log.warning("conductor at %s: %s (retrying)", self.endpoint, msg.message)
                await asyncio.sleep(TAKEN_RETRY_S)
                continue
            if isinstance(msg, P.Error):  # refused (wrong key kind, model, node id still taken): final
                raise HandshakeError(f"conductor at {self.endpoint} refused {self.node_id}: {msg.message}")
            log.warning("ignoring %s before registration", type(msg).__name__)

    def start_heartbeat(self, blocks: BlockEvents | None = None) -> None:
        """Heartbeat from now on (``blocks``: what the role caches, reported with them)."""
        self.beat_at = time.time()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(blocks)))

    async def _heartbeat_loop(self, blocks: BlockEvents | None) -> None:
        """A heartbeat at most ``heartbeat_s`` after the last beat, on the last tick of
        ``heartbeat_s / 2`` by then (an idle node keeps to one tick in two: nodes that start
        apart end up on one of two ticks a period); with blocks to report, on the next tick of
        ``REPORT_EVERY_S`` (one a tick: a timer may fire a little early)."""
        half = self.heartbeat_s / 2
        while True:
            now = time.time()
            due_s = last_tick(half, self.beat_at + self.heartbeat_s + SLACK_S) - now
            if blocks is not None and blocks.pending.is_set():
                await asyncio.sleep(min(due_s, until_tick(REPORT_EVERY_S, self.beat_at + REPORT_EVERY_S / 2 - now)))
            elif blocks is not None:
                try:
                    await asyncio.wait_for(blocks.pending.wait(), max(0.0, due_s))
                    continue  # blocks to report: on the next report tick
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(max(0.0, due_s))
            if time.time() - self.beat_at < half and not (blocks and blocks.pending.is_set()):
                continue  # a message that stands in for a heartbeat went meanwhile
            try:
                await self.send(P.Heartbeat(self.node_id, self._load(), blocks.take() if blocks else []), beat=True)
            except Exception:  # a heartbeat that cannot be built must not stop the role
                log.exception("heartbeat failed")  # blocks it took are lost: the next registration announces all
                self.beat_at = time.time()
                await asyncio.sleep(half)  # not once a report tick while it keeps failing

    async def recv(self) -> tuple[P.Msg, list[torch.Tensor]]:
        """Next message from the conductor; handles Registered/Reregister itself and
        drops malformed frames with a log line."""
        while True:
            frames = await recv_multipart(self.sock)
            try:
                msg, tensors = P.decode(frames)
            except P.ProtocolError as e:
                log.warning("dropping malformed message from conductor: %s", e)
                continue
            if not self.fence.admit(msg):  # from a stale conductor (counted, logged once per term)
                continue
            if isinstance(msg, P.Reregister):
                log.info("conductor asked %s to register again", self.node_id)
                self._reregistering = True
                await self._register()
                continue
            if isinstance(msg, P.Registered):
                # Answers to registrations queued before the conductor was up are ignored;
                # after a re-registration the role re-announces what it holds.
                self.heartbeat_s = msg.heartbeat_s
                self._reconcile(msg)
                if self._reregistering and self.on_registered is not None:
                    asyncio.create_task(self.on_registered())
                self._reregistering = False
                continue
            return msg, tensors

    def _load(self) -> Any:
        """The role's load; with the stale-term refusals of a fence that counts in no registry."""
        load = self.load()
        if self.fence.counter is None and self.fence.refused and isinstance(load, P.Load):
            load.stale_terms = dict(self.fence.refused)
        return load

    async def _register(self) -> None:
        self._held = self.holding()
        await self.send(msgspec.structs.replace(self.register_msg, holding=self._held, fallback=self.fallback(self._held)))

    def _reconcile(self, msg: P.Registered) -> None:
        """Drop what this role held that the conductor no longer knows here (once per registration)."""
        keep = set(msg.keep)
        orphans, self._held = [w for w in self._held if w not in keep], []
        if orphans and self.on_orphans is not None:
            log.warning("%s drops %d requests the conductor no longer knows here", self.node_id, len(orphans))
            self._tasks.append(asyncio.create_task(self.on_orphans(orphans)))

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.sock.close(0)
        if self.watch is not None:
            asyncio.get_running_loop().create_task(self.watch.close())
