"""Sessions, the conductor's half: a request that names a session (``session_id``, or OpenAI's
``user`` with ``[classes] session_from_user``; its ``Sampling.keep_s``, ``[classes] session_ttl_s``)
has the stores that hold its prompt's blocks keep them ``keep_s`` from now, evicted after every
block no session keeps, so that the session's next turn finds its prefix under pressure. The blocks
a turn computes are kept by the workers that write them (the store's ``Put``, the engine's prefix
cache). Each is kept for the request's tenant (``Sampling.tenant``), within its quota (``[classes]
session_blocks_per_key``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence

from mooncake import protocol as P
from mooncake.sched.node_registry import Cluster
from mooncake.sched.kv_index import KVIndex
from mooncake.tiers.client import StoreClient, StoreError

log = logging.getLogger(__name__)


class SessionKeeper:
    def __init__(self, cluster: Cluster, index: KVIndex, client: Callable[[str], StoreClient]) -> None:
        self.cluster = cluster
        self.index = index
        self.client = client
        self._tasks: set[asyncio.Task] = set()

    def turn(self, msg: P.Submit) -> None:
        """A request was placed: a session's first attempt has its prefix kept."""
        if msg.new_request and msg.sampling.keep_s > 0:
            self.keep(msg.hashes, msg.sampling.keep_s, msg.sampling.tenant)

    def keep(self, hashes: Sequence[bytes], keep_s: float, tenant: str = "") -> None:
        """Have each store holding some of ``hashes`` keep them ``keep_s`` from now for ``tenant`` (in
        the background)."""
        stores = {n.node_id: n.endpoints.get("store", "") for n in self.cluster.of_role("store")}
        by_store: dict[str, list[bytes]] = {}
        for h in hashes:
            for node_id in self.index.holders(h):
                if stores.get(node_id):
                    by_store.setdefault(stores[node_id], []).append(h)
        for endpoint, held in by_store.items():
            task = asyncio.get_running_loop().create_task(self._keep(endpoint, held, keep_s, tenant))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _keep(self, endpoint: str, hashes: list[bytes], keep_s: float, tenant: str) -> None:
        try:
            await self.client(endpoint).keep(hashes, keep_s, tenant)
        except StoreError as e:  # costs only the session's next hit (a closed client too)
            log.warning("keeping %d session blocks on %s failed: %s", len(hashes), endpoint, e)
