"""One fetch of an object into a store: chunks pulled from every holder at once.

Which chunk goes to which holder, and how many are in flight to each: mooncake/p2p/holders.py.
Every chunk is hashed (BLAKE3) as it is written, in a thread, so that both overlap the
transfer, and counted only if it matches its digest; a bad one is asked again from another
holder (its good copy overwrites it), and so is one whose holder disconnects or stays silent.
Each verified chunk is announced to the conductor at once, and the holder list is refreshed
every ``refresh_s``: peers fetching the same object serve each other during the distribution,
not only the seed.

Without CURVE each request asks for the bytes on the holder's bulk port (mooncake/p2p/bulk.py):
the reply is a token, the chunk is received, hashed and written in a thread, and stays in
flight to that holder until then. A bulk stream cut off (the holder died, its file shrank, a
timeout) is a lost chunk: asked again, from another holder if one has it. A bulk port that
takes no connection (a firewall that opens only the ZeroMQ port) turns bulk off for that
holder: the chunk, and every later one from it, is asked again over ZeroMQ.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import Executor

import msgspec
import zmq
import zmq.asyncio

from mooncake.p2p.bulk import BulkLink, BulkLost, BulkUnreachable
from mooncake.p2p.holders import Holders, Peer, choose_requests
from mooncake.p2p.manifest import ObjectError
from mooncake.protocol.p2p import ChunkBad, ChunkData, ChunkGet, Fetching, Have, Located, Locate, ProgressReport, decoder, encoder
from mooncake.p2p.objects import LocalObject
from mooncake.p2p.rpc import P2PError, Rpc
from mooncake.sockets import send_multipart

log = logging.getLogger(__name__)


class Fetch:
    def __init__(self, ctx: zmq.asyncio.Context, curve: object | None, meta: Rpc, node_id: str, obj: LocalObject,
                 save: object, in_flight_per_peer: int = 2, stall_timeout_s: float = 30.0,
                 chunk_timeout_s: float = 20.0, refresh_s: float = 0.25, only_from: list[str] | None = None,
                 bulk_receivers: Executor | None = None) -> None:
        """``save(obj)``: persist the object's record; ``meta``: the conductor; ``only_from``: node
        names to fetch from (default: every holder); ``bulk_receivers``: threads for bulk
        transfers (None, or under CURVE: every chunk over ZeroMQ)."""
        self.ctx, self.curve, self.meta, self.node_id, self.obj = ctx, curve, meta, node_id, obj
        self.save = save
        self.in_flight_per_peer = in_flight_per_peer
        self.stall_timeout_s, self.chunk_timeout_s, self.refresh_s = stall_timeout_s, chunk_timeout_s, refresh_s
        self.state, self.error = "fetching", ""
        self.finished = asyncio.Event()
        self.verify_s = 0.0
        self._first_request = 0.0
        self.transfer_s = 0.0
        self.events: asyncio.Queue = asyncio.Queue()
        self.bulk_receivers = bulk_receivers if curve is None else None
        self.holders = Holders(ctx, curve, obj.manifest.chunk_bytes + (1 << 16), self.events,
                               chunk_timeout_s if self.bulk_receivers is not None else None)
        self.bytes_by_peer: dict[str, int] = {}
        self._req = 0
        self._order = list(range(len(obj.spans)))
        random.shuffle(self._order)
        self._rank = {c: r for r, c in enumerate(self._order)}
        self._others_fetching: list[int] = []  # per chunk: other stores fetching it now
        self._writes: set[asyncio.Task] = set()
        self.bad_chunks = 0
        self.only_from = set(only_from or ())
        self._fatal: Exception | None = None  # a write that cannot go on (disk full)
        self.task: asyncio.Task | None = None  # running ``run`` (set by whoever starts it)
        self.removed = False
        self.bulk_bytes = 0

    def progress(self) -> ProgressReport:
        return ProgressReport(self.obj.name, self.obj.manifest.version, self.obj.done_bytes,
                              self.obj.manifest.total_bytes, self.state, self.error, dict(self.bytes_by_peer),
                              self.verify_s, self.transfer_s, self.bulk_bytes)

    def remove(self) -> None:
        """The object was removed cluster-wide: stop now, and leave no record of it behind."""
        self.removed = True
        self.state, self.error = "failed", f"{self.obj.name} was removed"
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        try:
            await self._run()
            self.state = "complete"
        except (ObjectError, P2PError, OSError) as e:
            self.state, self.error = "failed", str(e)
            log.error("p2p fetch of %s failed: %s", self.obj.name, e)
        finally:
            for t in list(self._writes):
                t.cancel()
            self.holders.close()
            if not self.removed:
                self.save(self.obj)
            self.finished.set()
        if self.state == "complete":
            try:
                await self.meta.call(Fetching(self.node_id, self.obj.name, []))
            except P2PError:
                pass  # the conductor forgets it with this store's registration anyway

    async def _run(self) -> None:
        obj = self.obj
        await asyncio.to_thread(obj.prepare)
        if obj.done:
            log.info("p2p %s: resuming, %d of %d chunks already on disk", obj.name, len(obj.done), len(obj.spans))
        # what this store holds now (a fetch into a new directory replaces what it held elsewhere)
        await self.meta.call(Have(self.node_id, obj.name, obj.manifest.version, sorted(obj.done), replace=True))
        self.save(obj)
        await self._refresh()
        refresher = asyncio.create_task(self._keep_refreshing())
        try:
            await self._receive()
        finally:
            refresher.cancel()
        t0 = time.monotonic()
        self.transfer_s = t0 - self._first_request if self._first_request else 0.0
        if self._writes:  # the last chunks' announcements: the conductor must know this store holds them
            await asyncio.wait(set(self._writes))
        await asyncio.to_thread(obj.verify_files)
        self.verify_s = time.monotonic() - t0

    async def _keep_refreshing(self) -> None:
        """The holder list, every ``refresh_s``, beside the receive loop (never inside it: a slow
        conductor must not hold up chunk replies and the requests that follow them)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self._refresh()
            except (ObjectError, P2PError) as e:
                self._fatal = e
            self.events.put_nowait((None, None))  # wake the receive loop: new holders, or the error
            if self._fatal is not None:
                return

    async def _receive(self) -> None:
        """Until every chunk is verified and written (or an error is raised)."""
        obj = self.obj
        last_progress = time.monotonic()
        while not obj.complete:
            now = time.monotonic()
            self._expire(now)
            self._assign()
            try:
                peer, frames = await asyncio.wait_for(self.events.get(), self.refresh_s)
            except asyncio.TimeoutError:
                peer, frames = None, None
            if peer is not None and self._on_reply(peer, frames) or frames is True:  # True: a bulk chunk verified
                last_progress = time.monotonic()
            if self._writes and not any(p.in_flight for p in self.holders.peers.values()):
                await asyncio.wait(set(self._writes), timeout=self.refresh_s)
                last_progress = time.monotonic() if obj.done else last_progress
            if self._fatal is not None:
                raise self._fatal
            if time.monotonic() - last_progress > self.stall_timeout_s and not self._writes:
                raise ObjectError(self._stall_reason())

    def _stall_reason(self) -> str:
        missing = sorted(set(range(len(self.obj.spans))) - self.obj.done)
        holders = [p.name for p in self.holders.peers.values()]
        bad = sorted({c for p in self.holders.peers.values() for c in p.bad} & set(missing))
        why = f"; chunks {bad[:5]} failed verification from every holder" if bad else ""
        return (f"{self.obj.name}: no progress for {self.stall_timeout_s:.0f}s with {len(missing)} of "
                f"{len(self.obj.spans)} chunks missing (holders: {', '.join(holders) or 'none alive'}){why}")

    async def _refresh(self) -> None:
        mine = sorted(self.holders.in_flight())
        try:
            await self.meta.call(Fetching(self.node_id, self.obj.name, mine))
            loc = await self.meta.call(Locate(self.obj.name))
        except P2PError as e:
            if e.code == "unknown":
                raise ObjectError(f"{self.obj.name} was removed while fetching") from None
            raise
        assert isinstance(loc, Located)
        if loc.manifest.version != self.obj.manifest.version:
            raise ObjectError(f"{self.obj.name} changed while fetching (now version {loc.manifest.version[:12]})")
        self._others_fetching = [max(0, k - (i in mine)) for i, k in enumerate(loc.fetching)]
        self.holders.update(loc.holders, self.node_id, self.only_from)

    def _ban(self, peer: Peer, why: str) -> None:
        log.warning("p2p %s: dropping holder %s (%s); its %d chunks in flight go to others", self.obj.name,
                    peer.name, why, len(peer.in_flight))
        self.holders.ban(peer, max(5.0, 4 * self.refresh_s))

    def _expire(self, now: float) -> None:
        for peer in list(self.holders.peers.values()):
            silent = now - peer.last_reply > self.chunk_timeout_s
            if silent and any(now - sent > self.chunk_timeout_s for _, sent in peer.in_flight.values()):
                self._ban(peer, f"no chunk for {self.chunk_timeout_s:.0f}s")

    def _assign(self) -> None:
        """Fill the holders' free request slots (``choose_requests``)."""
        taken = self.holders.in_flight()
        taken |= {t.chunk for t in self._writes}  # type: ignore[attr-defined]
        wanted = [c for c in self._order if c not in self.obj.done and c not in taken]
        if wanted:
            for peer, chunk in choose_requests(list(self.holders.peers.values()), wanted, self._others_fetching, self._rank,
                                               self.in_flight_per_peer):
                self._request(peer, chunk)

    def _request(self, peer: Peer, chunk: int) -> None:
        self._first_request = self._first_request or time.monotonic()
        self._req += 1
        peer.in_flight[self._req] = (chunk, time.monotonic())
        bulk = peer.bulk is not None and not peer.bulk.off
        msg = ChunkGet(self._req, self.obj.name, self.obj.manifest.version, chunk, bulk=bulk)
        asyncio.create_task(send_multipart(peer.sock, [encoder.encode(msg)]))

    def _on_reply(self, peer: Peer, frames: list | None) -> bool:
        if not self.holders.current(peer):
            return False  # from a holder already dropped
        if frames is None:
            self._ban(peer, "disconnected or refused")
            return False
        try:
            head = decoder.decode(frames[0].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            head = None
        if not isinstance(head, ChunkData) or head.req not in peer.in_flight:
            log.warning("p2p %s: unexpected reply from %s", self.obj.name, peer.name)
            return False
        if head.token and not head.missing:
            if peer.bulk is None or peer.bulk.off:  # asked before bulk went off for it: ask again over ZeroMQ
                peer.in_flight.pop(head.req)
                return False
            chunk = peer.in_flight[head.req][0]  # in flight until it is written
            self._track(asyncio.create_task(self._bulk(peer, peer.bulk, head, chunk)), chunk)
            return False
        chunk, sent_at = peer.in_flight.pop(head.req)
        if head.missing or len(frames) != 2:
            peer.last_reply = time.monotonic()
            peer.chunks.discard(chunk)
            log.warning("p2p %s: %s does not serve chunk %d (%s)", self.obj.name, peer.name, chunk,
                        head.missing or "no data")
            return False
        peer.delivered(len(frames[1].buffer), sent_at, time.monotonic())
        self._track(asyncio.create_task(self._write(peer, chunk, frames[1])), chunk)
        return True

    def _track(self, task: asyncio.Task, chunk: int) -> None:
        """A task writing ``chunk``: the chunk is not asked again until it ends."""
        task.chunk = chunk  # type: ignore[attr-defined]
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _bulk(self, peer: Peer, link: BulkLink, head: ChunkData, chunk: int) -> None:
        """Receive a granted chunk on the holder's bulk port (hashed and written in a thread)."""
        ok: bool | None = None
        try:
            ok = await link.receive(self.bulk_receivers, head.token, head.bulk_port, self.obj, chunk)  # type: ignore[arg-type]
        except BulkUnreachable:
            pass  # nothing arrived: asked again over ZeroMQ (link.off); kept in peer.chunks
        except BulkLost as e:
            if self.holders.current(peer):
                peer.chunks.discard(chunk)  # until the next refresh: another holder first
                log.warning("p2p %s: chunk %d from %s lost (%s); asking again", self.obj.name, chunk, peer.name, e)
        except (ObjectError, OSError) as e:
            self._fatal = e
            return
        finally:
            entry = peer.in_flight.pop(head.req, None) if self.holders.current(peer) else None
        if ok is None:
            self.events.put_nowait((None, None))
            return
        if entry is not None:
            peer.delivered(self.obj.spans[chunk].length, entry[1], time.monotonic())
        if ok:
            self.bulk_bytes += self.obj.spans[chunk].length
        elif entry is not None:
            bad = ChunkBad(self.obj.name, self.obj.manifest.version, chunk)  # the holder checks its copy
            asyncio.create_task(send_multipart(peer.sock, [encoder.encode(bad)]))
        await self._written(peer, chunk, ok, wake=True)

    async def _write(self, peer: Peer, chunk: int, frame: zmq.Frame) -> None:
        try:
            ok = await asyncio.to_thread(self.obj.write_chunk, chunk, frame.buffer)
        except (ObjectError, OSError) as e:
            self._fatal = e
            return
        await self._written(peer, chunk, ok)

    async def _written(self, peer: Peer, chunk: int, ok: bool, wake: bool = False) -> None:
        """A chunk was written: count and announce it if it matched its digest, else ask another
        holder. ``wake``: tell the receive loop (a bulk transfer's slot is free)."""
        if not ok:
            self.bad_chunks += 1
            peer.bad.add(chunk)
            log.warning("p2p %s: chunk %d from %s failed verification; asking another holder", self.obj.name,
                        chunk, peer.name)
            if wake:
                self.events.put_nowait((None, None))
            return
        self.obj.done.add(chunk)
        length = self.obj.spans[chunk].length
        self.bytes_by_peer[peer.name] = self.bytes_by_peer.get(peer.name, 0) + length
        self.save(self.obj)
        if wake:
            self.events.put_nowait((None, True))
        try:
            await self.meta.call(Have(self.node_id, self.obj.name, self.obj.manifest.version, [chunk]))
        except P2PError as e:
            log.warning("p2p %s: announcing chunk %d failed: %s", self.obj.name, chunk, e)
