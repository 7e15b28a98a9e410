"""The node side of ``mooncake p2p`` (and of ``[model] p2p_name``): finds this node's store
through the conductor by ``[node] name`` and asks it to publish or fetch (with the node key its
store wrote into ``[store] data_dir``: only the node's own processes can); lists and removes
objects at the conductor."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

import zmq.asyncio

from mooncake.config import Config
from mooncake.protocol.p2p import (Done, FindStore, GetObject, ListObjects, Listing, Progress, ProgressReport,
                                   PutObject, RemoveObject, StoreAt)
from mooncake.p2p.manifest import ObjectError
from mooncake.p2p.node_access import read_node_key, read_store_endpoint
from mooncake.p2p.rpc import P2PError, Rpc
from mooncake.security import Curve, check_network


class P2PClient:
    def __init__(self, cfg: Config, role: str = "store") -> None:
        """``role``: whose CURVE key to present (the CLI uses the node's store key, workers theirs)."""
        self.cfg = cfg
        check_network("p2p client", [cfg.conductor.endpoint], cfg.security.curve_keys_dir,
                      cfg.security.allow_insecure_network)
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir, role)
        self.ctx = zmq.asyncio.Context()
        self.conductor = Rpc(self.ctx, cfg.conductor.endpoint, self.curve, "conductor")
        self._store: Rpc | None = None
        self.key = ""

    async def store(self, wait_s: float = 0.0) -> Rpc:
        """This node's store; ``wait_s``: how long to wait for it (and the conductor) to come up."""
        deadline = time.monotonic() + wait_s
        while self._store is None:
            try:
                at = await self.conductor.call(FindStore(self.cfg.node.name))
            except P2PError as e:
                if e.code not in ("no_store", "timeout") or time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)
                continue
            assert isinstance(at, StoreAt)
            try:  # written by the store as it starts, so read once it is up
                self.key = read_node_key(self.cfg)
            except ObjectError as e:
                raise P2PError(str(e), "forbidden") from None
            mine = read_store_endpoint(self.cfg, at.node_id)
            if at.endpoint != mine:  # not a store of this node (none wrote that beside the key), or restarting
                if time.monotonic() >= deadline:
                    raise P2PError(f"the store registered as {at.node_id} for node {self.cfg.node.name!r} "
                                   f"({at.endpoint}) is not one this node's stores wrote beside its key "
                                   f"({mine or 'none'}): the node key goes to those only", "no_store")
                await asyncio.sleep(0.5)
                continue
            self._store = Rpc(self.ctx, mine, self.curve, "store", timeout_s=600.0)
        return self._store

    async def put(self, name: str, path: str | Path) -> str:
        reply = await (await self.store()).call(PutObject(name, str(Path(path).expanduser().resolve()), self.key))
        assert isinstance(reply, Done)
        return reply.message

    async def get(self, name: str, dest: str | Path,
                  on_progress: Callable[[ProgressReport], None] | None = None,
                  poll_s: float = 0.2, only_from: list[str] | None = None) -> ProgressReport:
        """Fetch ``name`` into ``dest`` (created if absent); returns when complete, raises P2PError on
        failure. ``only_from``: node names to fetch from (default: every holder)."""
        dest = Path(dest).expanduser().resolve()
        store = await self.store()
        await store.call(GetObject(name, str(dest), list(only_from or ()), self.key))
        while True:  # each answer comes after poll_s, or at once when the fetch ends
            report = await store.call(Progress(name, wait_s=poll_s, key=self.key), timeout_s=30.0)
            assert isinstance(report, ProgressReport)
            if on_progress is not None:
                on_progress(report)
            if report.state == "complete":
                return report
            if report.state == "failed":
                raise P2PError(f"fetching {name} failed: {report.error}")

    async def knows(self, name: str) -> bool:
        """Whether this node's store holds or fetches ``name`` (completely or in part)."""
        try:
            store = await self.store()
            await store.call(Progress(name, key=self.key))
        except P2PError as e:
            if e.code == "unknown":
                return False
            raise
        return True

    async def ls(self) -> Listing:
        reply = await self.conductor.call(ListObjects())
        assert isinstance(reply, Listing)
        return reply

    async def rm(self, name: str) -> str:
        reply = await self.conductor.call(RemoveObject(name))
        assert isinstance(reply, Done)
        return reply.message

    def close(self) -> None:
        self.conductor.close()
        if self._store is not None:
            self._store.close()
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fetch_model(cfg: Config, role: str) -> None:
    """``[model] p2p_name`` for a worker: fetch the model directory into ``[model] path``
    through this node's store when it is missing. A directory with files is left alone
    unless this node's store knows the object: then its fetch may be under way (another
    worker of the node started it: its files exist at full size before their chunks are
    in) or was interrupted, and the worker waits for it, or resumes it, before loading."""
    path = Path(cfg.model.path).expanduser() if cfg.model.path else None
    if not cfg.model.p2p_name:
        return
    if path is None:
        raise P2PError("[model] p2p_name needs [model] path: the directory to fetch the model into")
    name = cfg.model.p2p_name

    async def run() -> None:
        client = P2PClient(cfg, role)
        try:
            await client.store(wait_s=cfg.model.p2p_store_wait_s)  # the node's roles start in any order
            if path.is_dir() and any(path.iterdir()) and not await client.knows(name):
                return
            await client.get(name, path)
        finally:
            client.close()

    if _loop_running():
        _in_thread(run)
    else:
        asyncio.run(run())


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _in_thread(run: Callable) -> None:
    """Run a coroutine function to completion from code already inside an event loop."""
    import threading

    err: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(run())
        except BaseException as e:  # re-raised in the caller's thread
            err.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if err:
        raise err[0]

