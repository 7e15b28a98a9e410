"""StoreServer: the tiered store's object API on a ZeroMQ ROUTER socket (asyncio).

Wire: a request is ``[request_id, *protocol frames]`` from a DEALER (the ROUTER
sees the peer identity first); the reply is ``[request_id, *protocol frames]``
back to that peer. ``request_id`` is opaque (<= 64 bytes) and echoed, so one
client socket can have many requests in flight. Tensors are payload frames,
sent and received without copies. Anything malformed or unknown is answered
with ``Error`` and the server carries on; so is a store order (``Keep``, ``Replicate``, ``Remove``)
of an older leadership term than the newest seen (``Error`` code ``stale_term``: ``term_fence.py``).

Every store operation that may copy or touch LMDB runs in a worker thread
(``store_requests.py``: what each request does, owned by the server); the event loop
only moves frames, so it keeps answering (``exists`` is answered on the loop from the key index). Run standalone::

    python -m mooncake.tiers.server --endpoint tcp://127.0.0.1:0 --data-dir DIR

prints ``READY <endpoint>`` once bound, and serves until SIGTERM/SIGINT (then moves its
memory blocks to LMDB, as the store role does).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import signal
import sys
import time
from typing import Any, Callable, Iterable

import zmq
import zmq.asyncio

from ..config import StoreConfig
from ..kv.integrity import Rejections
from ..protocol import BlockEvent, Error, GetLayers, ProtocolError, decode, encode
from ..security import Curve, store_access_problem
from ..sockets import DEFAULT_MAX_MSG_BYTES, limit_message_size, recv_multipart, send_multipart
from ..term_fence import TermFence
from .client import StoreError
from .store_requests import StoreRequests
from .tiered import TieredStore

log = logging.getLogger(__name__)
MAX_RID = 64


class StoreServer:
    def __init__(self, store: TieredStore, bind_endpoint: str,
                 on_event: Callable[[BlockEvent], Any] | None = None, node_id: str = "",
                 workers: int = 4, curve: Curve | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MSG_BYTES, fence: TermFence | None = None) -> None:
        """``fence``: the newest leadership term seen (``term_fence.py``): store orders of an older one
        are refused (the store role's link to the conductor shares it)."""
        self.max_message_bytes = max_message_bytes
        self.fence = fence if fence is not None else TermFence(node_id)
        self.rejections = Rejections()  # requests refused: unauthorized key, corrupt block
        self.store = store
        self.curve = curve
        self.requests = StoreRequests(store, self.rejections, node_id=node_id, curve=curve, workers=workers)
        self.bind_endpoint = bind_endpoint
        self.on_event = on_event
        self.node_id = node_id
        self.endpoint = ""
        self._tasks: set[asyncio.Task] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recv_task: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> str:
        """Bind and start serving; returns the actual endpoint (port 0 resolved)."""
        self._loop = asyncio.get_running_loop()
        self.store.on_event = self._store_event
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        limit_message_size(self._sock, self.max_message_bytes)
        if self.curve is not None:
            self.curve.server(self._sock, self._ctx)
        self._sock.bind(self.bind_endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._recv_task = asyncio.create_task(self._serve())
        return self.endpoint

    async def close(self) -> None:
        if self._recv_task:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            if self.curve is not None:
                self.curve.stop()
            self._ctx.term()
            self._sock = None
        self.requests.close()

    def stored_hashes(self) -> Iterable[tuple[bytes, str]]:
        """(hash, tier) of every held block, for re-announcing after (re)registration."""
        return self.store.stored()

    def _store_event(self, kind: str, tier: str, keys: list[bytes]) -> None:
        if self.on_event is None or self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._emit, BlockEvent(self.node_id, kind, tier, list(keys)))

    def _emit(self, ev: BlockEvent) -> None:
        try:
            r = self.on_event(ev)  # type: ignore[misc]
            if inspect.isawaitable(r):
                self._spawn(r)
        except Exception:
            log.exception("on_event failed")

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- serving

    async def _serve(self) -> None:
        while True:
            frames = await recv_multipart(self._sock)
            self._spawn(self._handle(frames))

    async def _handle(self, frames: list) -> None:
        ident = frames[0].bytes
        rid = frames[1].bytes if len(frames) > 1 else b""
        reply: list
        try:
            if len(frames) < 3 or len(rid) > MAX_RID:
                raise ProtocolError("expected [request_id, message, payload...]")
            msg, tensors = decode(frames[2:])
            refused = store_access_problem(self.curve, frames[1], msg)
            if refused is not None:
                self.rejections.add("unauthorized")
                log.warning("refused: %s", refused)
                reply = encode(Error(refused, "unauthorized"))
            elif not self.fence.admit(msg):  # a stale conductor's order: not acted on
                reply = encode(Error(f"leadership term {getattr(msg, 'term', 0)} is older than {self.fence.term}",
                                     "stale_term"))
            elif isinstance(msg, GetLayers):
                async for reply in self.requests.stream_layers(msg):
                    await send_multipart(self._sock, [ident, rid[:MAX_RID], *reply])
                return
            else:
                reply = await self.requests.handle(msg, tensors)
        except ProtocolError as e:
            reply = encode(Error(str(e), "bad_request"))
        except StoreError as e:
            reply = encode(Error(str(e), "upstream"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a bad value must not kill the server
            log.exception("store request failed")
            reply = encode(Error(f"{type(e).__name__}: {e}", "internal"))
        try:
            await send_multipart(self._sock, [ident, rid[:MAX_RID], *reply])
        except zmq.ZMQError as e:
            log.warning("reply not sent: %s", e)


# -------------------------------------------------------------------- standalone entry


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mooncake.tiers.server", description="Serve a tiered KV store.")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:0")
    p.add_argument("--data-dir", default=StoreConfig().data_dir)
    p.add_argument("--node-id", default="store", help="LMDB lives in DATA_DIR/NODE_ID")
    p.add_argument("--device-bytes", type=int, default=0)
    p.add_argument("--dram-bytes", type=int, default=StoreConfig().dram_bytes)
    p.add_argument("--lmdb-bytes", type=int, default=StoreConfig().lmdb_bytes)
    p.add_argument("--ssd-admission", choices=["on_demotion", "after_hits", "write_through"], default="on_demotion")
    p.add_argument("--ssd-admission-hits", type=int, default=1)
    p.add_argument("--no-promote", action="store_true")
    return p.parse_args(argv)


async def _amain(args: argparse.Namespace) -> None:
    cfg = StoreConfig(device_bytes=args.device_bytes, dram_bytes=args.dram_bytes, lmdb_bytes=args.lmdb_bytes,
                      data_dir=args.data_dir, ssd_admission=args.ssd_admission,
                      ssd_admission_hits=args.ssd_admission_hits, promote_on_hit=not args.no_promote)
    store = TieredStore.from_config(cfg, args.node_id)
    server = StoreServer(store, args.endpoint, node_id=args.node_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    endpoint = await server.start()
    print(f"READY {endpoint}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        await loop.run_in_executor(None, store.persist, time.monotonic() + 30)
        store.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(_amain(_parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
