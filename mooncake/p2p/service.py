"""The P2P half of a store role: serves chunks to peers, publishes and fetches objects for
its node (``mooncake p2p put/get``, a worker's ``[model] p2p_name``), and keeps the
conductor's index told of what it holds.

One ROUTER socket. Peers send ``ChunkGet`` (store keys only, under CURVE); the node's
CLI and workers send ``PutObject`` / ``GetObject`` / ``Progress`` (store or worker keys under
CURVE, and always the node key), for paths under ``p2p_root`` only (mooncake/p2p/node_access.py).
Chunks are read and checked in a thread, at most ``READERS`` at a time, and leave as one
zero-copy frame each. A chunk that no longer verifies on disk is not served: it is
dropped from this store's holdings (announced) and the asker goes to another holder.

Without CURVE a peer may ask for a chunk's bytes on the bulk port instead (``ChunkGet.bulk``,
mooncake/p2p/bulk_server.py; ``[node] p2p_bulk_port``, else any free port): the reply is a one-time token, and the chunk leaves by ``sendfile``,
unread here; a fetcher whose copy fails its digest says so (``ChunkBad``), and this store
then checks its own (as it does when a chunk's file ends early). Under CURVE there is no
bulk port: every byte stays on the encrypted, authenticated socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import msgspec
import zmq
import zmq.asyncio

from mooncake.p2p.bulk_server import BulkServer
from mooncake.p2p.fetch import Fetch
from mooncake.p2p.manifest import DEFAULT_CHUNK_BYTES, ObjectError, build_manifest, check_name, validate
from mooncake.p2p.node_access import confined, same_key
from mooncake.protocol.p2p import (ChunkBad, ChunkData, ChunkGet, Done, Failure, GetObject, Have, Located, Locate, P2PMsg,
                                   Progress, ProgressReport, Publish, PutObject, decoder, encoder)
from mooncake.p2p.objects import ChunkCorrupt, LocalObject, NotHeld, ObjectStore
from mooncake.p2p.rpc import P2PError, Rpc
from mooncake.security import kind_of, peer_of
from mooncake.sockets import limit_message_size, recv_multipart, send_multipart

log = logging.getLogger(__name__)
READERS = 4
BULK_RECEIVERS = 16  # chunks this store's fetches receive on bulk ports at once (threads)
# Fault injection for tests: this store corrupts every chunk it serves (after reading it).
CORRUPT_ENV = "MOONCAKE_FAULT_P2P_CORRUPT_SERVE"
ACCESS = {ChunkGet: ("store",), ChunkBad: ("store",), PutObject: ("store", "worker"), GetObject: ("store", "worker"),
          Progress: ("store", "worker")}
NODE_ONLY = (PutObject, GetObject, Progress)  # these carry the node key


class P2PService:
    def __init__(self, ctx: zmq.asyncio.Context, node_id: str, directory: Path, bind: str,
                 conductor_endpoint: str, curve: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 in_flight_per_peer: int = 2, stall_timeout_s: float = 30.0, bulk_port: int = 0, *,
                 root: Path, node_key: str, private: Sequence[Path] = ()) -> None:
        """``bulk_port``: the TCP port chunk bytes leave on without CURVE (0: any free one); ``root``: the
        only tree objects are published from and fetched into; ``node_key``: what object requests carry;
        ``private``: paths no published tree may hold or lie in (the node key, the store's data)."""
        self.ctx, self.node_id, self.curve = ctx, node_id, curve
        self.root, self.node_key = Path(root).resolve(), node_key
        self.private = [Path(p).resolve() for p in private]
        self.chunk_bytes, self.in_flight_per_peer, self.stall_timeout_s = chunk_bytes, in_flight_per_peer, stall_timeout_s
        self.objects = ObjectStore(directory)
        self.fetches: dict[str, Fetch] = {}
        self.meta = Rpc(ctx, conductor_endpoint, curve, "conductor")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        limit_message_size(self.sock, 1 << 20)  # requests only: chunks go out, never in
        if curve is not None:
            curve.server(self.sock, ctx)
        self.sock.bind(bind)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._send_lock = asyncio.Lock()
        self._readers = asyncio.Semaphore(READERS)
        self._tasks: set[asyncio.Task] = set()
        self._corrupt = os.environ.get(CORRUPT_ENV) == "1"
        self.bulk: BulkServer | None = None  # never under CURVE
        self._bulk_receivers: ThreadPoolExecutor | None = None
        if curve is None:
            host = bind.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
            self.bulk = BulkServer("0.0.0.0" if host == "*" else host, bulk_port, on_short=self._on_short,
                                   corrupt=self._corrupt)
            self._bulk_receivers = ThreadPoolExecutor(BULK_RECEIVERS, thread_name_prefix="p2p-bulk-recv")

    def start(self) -> None:
        loaded = self.objects.load(self.root)
        if loaded:
            log.info("p2p: %d objects on disk (%d complete)", len(loaded), sum(o.complete for o in loaded))
        self._spawn(self._serve())
        if self.bulk is not None:
            self.bulk.start()

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def announce(self) -> None:
        """Tell the conductor everything held (at registration and re-registration)."""
        for obj in list(self.objects.objects.values()):
            try:
                if obj.complete:
                    await self.meta.call(Publish(self.node_id, obj.manifest))
                elif obj.done:
                    await self.meta.call(Have(self.node_id, obj.name, obj.manifest.version, sorted(obj.done),
                                              replace=True))
            except P2PError as e:
                log.warning("p2p: announcing %s failed: %s", obj.name, e)

    def forget(self, name: str) -> None:
        """The object was removed cluster-wide: stop serving and fetching it (its files stay)."""
        fetch = self.fetches.get(name)
        if fetch is not None and fetch.state == "fetching":
            fetch.remove()  # kept: its progress says why it failed; its files close once its writes end
        if self.objects.forget(name):
            log.info("p2p: forgot %s", name)

    async def close(self) -> None:
        """Stop serving and fetching (an interrupted fetch resumes from disk next time)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # fetches close their peers' sockets
        if self.bulk is not None:
            await self.bulk.close()
        if self._bulk_receivers is not None:
            self._bulk_receivers.shutdown(wait=False, cancel_futures=True)
        self.sock.close(0)
        self.meta.close()
        self.objects.close()

    # ---- the socket

    async def _serve(self) -> None:
        while True:
            frames = await recv_multipart(self.sock)
            try:
                msg = decoder.decode(frames[1].bytes)
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError) as e:
                log.warning("p2p: dropping malformed request: %s", e)
                continue
            ident = frames[0].bytes
            kinds = ACCESS.get(type(msg))
            if kinds is None or (self.curve is not None and kind_of(peer_of(frames[1])) not in kinds):
                await self._reply(ident, Failure(f"{type(msg).__name__} not accepted here", "forbidden"))
                continue
            if isinstance(msg, NODE_ONLY) and not same_key(msg.key, self.node_key):
                await self._reply(ident, Failure(f"{type(msg).__name__}: only this store's own node may ask (its CLI "
                                                 f"and roles, with its configuration and data_dir)", "forbidden"))
                continue
            if isinstance(msg, ChunkBad):  # no reply
                self._spawn(self._complaint(msg))
                continue
            if isinstance(msg, ChunkGet) and msg.bulk and self.bulk is not None:
                self._spawn(self._grant(ident, msg, _peer_address(frames[1])))
                continue
            self._spawn(self._handle(ident, msg))

    async def _reply(self, ident: bytes, msg: P2PMsg, *data: Any) -> None:
        async with self._send_lock:
            await send_multipart(self.sock, [ident, encoder.encode(msg), *data], copy=False)

    async def _handle(self, ident: bytes, msg: P2PMsg) -> None:
        try:
            if isinstance(msg, ChunkGet):
                await self._chunk(ident, msg)
                return
            if isinstance(msg, PutObject):
                reply: P2PMsg = await self._put(msg)
            elif isinstance(msg, GetObject):
                reply = await self._get(msg)
            else:
                reply = await self._progress(msg)  # type: ignore[arg-type]
        except (ObjectError, P2PError, OSError) as e:
            reply = Failure(str(e), getattr(e, "code", "error"))
        except Exception as e:  # a request must never kill the service
            log.exception("p2p: %s failed", type(msg).__name__)
            reply = Failure(f"{type(e).__name__}: {e}")
        await self._reply(ident, reply)

    def _held(self, msg: ChunkGet | ChunkBad) -> LocalObject | None:
        obj = self.objects.objects.get(msg.name)
        if obj is None or obj.manifest.version != msg.version or msg.index not in obj.done:
            return None
        return obj

    async def _grant(self, ident: bytes, msg: ChunkGet, peer: str) -> None:
        """A bulk request: a one-time token for the chunk, if held (its bytes are not read here)."""
        obj = self._held(msg)
        if obj is None:
            await self._reply(ident, ChunkData(msg.req, msg.index, "not held"))
            return
        assert self.bulk is not None
        token = self.bulk.grant(obj, msg.index, peer)
        await self._reply(ident, ChunkData(msg.req, msg.index, token=token, bulk_port=self.bulk.port))

    async def _complaint(self, msg: ChunkBad) -> None:
        obj = self._held(msg)
        if obj is not None:
            await self._check(obj, msg.index)

    def _on_short(self, obj: LocalObject, index: int) -> None:
        self._spawn(self._check(obj, index))

    async def _check(self, obj: LocalObject, index: int) -> None:
        """Check a chunk on disk (its BLAKE3) after a bulk copy of it went wrong; drop it if it fails."""
        try:
            async with self._readers:
                await asyncio.to_thread(obj.read_chunk, index, True)
        except NotHeld:
            return
        except (ChunkCorrupt, OSError) as e:
            await self._lose(obj, index, e)

    async def _lose(self, obj: LocalObject, index: int, why: Exception) -> None:
        """A chunk no longer verifies on disk: stop serving it and tell the conductor."""
        log.error("p2p: %s; no longer serving it", why)
        obj.done.discard(index)
        self.objects.save(obj)
        try:
            await self.meta.call(Have(self.node_id, obj.name, obj.manifest.version, sorted(obj.done), replace=True))
        except P2PError as err:
            log.warning("p2p: announcing the loss failed: %s", err)

    async def _chunk(self, ident: bytes, msg: ChunkGet) -> None:
        obj = self._held(msg)
        if obj is None:
            await self._reply(ident, ChunkData(msg.req, msg.index, "not held"))
            return
        try:
            async with self._readers:
                data = await asyncio.to_thread(obj.read_chunk, msg.index)
        except NotHeld:  # removed while the request waited
            await self._reply(ident, ChunkData(msg.req, msg.index, "not held"))
            return
        except (ChunkCorrupt, OSError) as e:
            await self._reply(ident, ChunkData(msg.req, msg.index, "corrupt on this holder"))
            await self._lose(obj, msg.index, e)
            return
        if self._corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        await self._reply(ident, ChunkData(msg.req, msg.index), data)

    async def _put(self, msg: PutObject) -> P2PMsg:
        check_name(msg.name)
        path = confined(self.root, msg.path)
        if self._private(path):
            raise ObjectError(f"{msg.path} holds this store's node key or data, or lies in it: not published")
        root, manifest = await asyncio.to_thread(build_manifest, msg.name, path, self.chunk_bytes, self.root)
        await self.meta.call(Publish(self.node_id, manifest))
        obj = LocalObject(manifest, root, set(range(len(manifest.checksums))))
        self.objects.add(obj)
        return Done(f"published {manifest.name} version {manifest.version[:12]}: {len(manifest.files)} files, "
                    f"{manifest.total_bytes} bytes, {len(manifest.checksums)} chunks")

    def _private(self, path: Path) -> bool:
        """Whether ``path`` holds a private path or lies inside one. A p2p root set apart inside a
        private directory (the default: <data_dir>/p2p-objects) is not private itself."""
        for p in self.private:
            root_apart = self.root != p and self.root.is_relative_to(p)
            if p.is_relative_to(path) or (path.is_relative_to(p) and not root_apart):
                return True
        return False

    async def _get(self, msg: GetObject) -> P2PMsg:
        check_name(msg.name)
        dest = confined(self.root, msg.dest)
        if (fetching := self._fetching(msg)) is not None:
            return fetching
        loc = await self.meta.call(Locate(msg.name))
        assert isinstance(loc, Located)
        # checked and its chunk table listed (up to MAX_CHUNKS spans) off the loop
        obj = await asyncio.to_thread(lambda: LocalObject(validate(loc.manifest), dest))
        if (fetching := self._fetching(msg)) is not None:  # a get that came meanwhile started it
            return fetching
        have = self.objects.objects.get(msg.name)
        if have is not None and have.manifest.version == obj.manifest.version and have.root == dest and have.complete:
            return Done("already complete")
        self.objects.add(obj)
        fetch = Fetch(self.ctx, self.curve, self.meta, self.node_id, obj, self.objects.save,
                      self.in_flight_per_peer, self.stall_timeout_s, only_from=msg.only_from,
                      bulk_receivers=self._bulk_receivers)
        self.fetches[msg.name] = fetch
        fetch.task = self._spawn(fetch.run())
        return Done("fetching")

    def _fetching(self, msg: GetObject) -> Done | None:
        """The reply to ``msg`` when a fetch of its object is under way (an error if into another
        directory than ``msg.dest``); None when none is."""
        fetch = self.fetches.get(msg.name)
        if fetch is None or fetch.state != "fetching":
            return None
        if fetch.obj.root != confined(self.root, msg.dest):
            raise ObjectError(f"{msg.name} is being fetched into {fetch.obj.root} already")
        return Done("already fetching")

    async def _progress(self, msg: Progress) -> P2PMsg:
        name = msg.name
        fetch = self.fetches.get(name)
        if fetch is not None:
            if fetch.state == "fetching" and msg.wait_s > 0:
                try:
                    await asyncio.wait_for(fetch.finished.wait(), min(msg.wait_s, 5.0))
                except asyncio.TimeoutError:
                    pass
            return fetch.progress()
        obj = self.objects.objects.get(name)
        if obj is None:
            return Failure(f"{name} is not being fetched by this store", "unknown")
        return ProgressReport(name, obj.manifest.version, obj.done_bytes, obj.manifest.total_bytes,
                              "complete" if obj.complete else "failed", "" if obj.complete else "interrupted")


def _peer_address(frame: Any) -> str:
    """The IP address a received frame came from ("" if libzmq does not say)."""
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""
