"""Hot-block replication, the conductor's policy half: count hits per block in a
sliding window and have a store holding a hot block copy it to another store,
until the block has the configured number of replicas. The copy itself is the
store's ``Replicate`` command (the store role executes it)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from mooncake.config import ReplicationConfig
from mooncake.metrics import Metrics
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.hot_blocks import HotBlocks
from mooncake.sched.kv_index import KVIndex
from mooncake.security import Curve
from mooncake.tiers.client import StoreClient, StoreError

log = logging.getLogger(__name__)


class Replicator:
    def __init__(self, cfg: ReplicationConfig, cluster: Cluster, index: KVIndex, metrics: Metrics,
                 curve: Curve | None, term: Callable[[], int] = lambda: 0) -> None:
        """``term()``: the leader's term, which its store orders carry (``term_fence.py``)."""
        self.cfg = cfg
        self.term = term
        self.cluster = cluster
        self.index = index
        self.metrics = metrics
        self.curve = curve
        self.hot = HotBlocks(cfg.hot_block_hits, cfg.hot_window_s)
        self._replicating: set[bytes] = set()
        self._stores: dict[str, StoreClient] = {}

    def note_hits(self, hashes: list[bytes]) -> None:
        """A request reused these blocks; replicate the ones that became hot."""
        stores = {n.node_id: n for n in self.cluster.of_role("store")}
        if len(stores) < 2:  # nowhere to replicate to
            return
        hot = [h for h in self.hot.hit(hashes, time.monotonic()) if h not in self._replicating]
        if not hot:
            return
        want = min(self.cfg.replicas, len(stores))
        by_pair: dict[tuple[str, str], list[bytes]] = {}
        for h in hot:
            holders = [n for n in self.index.holders(h) if n in stores]
            if not holders or len(holders) >= want:
                continue
            target = min((s for s in stores if s not in holders), key=self.index.blocks_of)
            by_pair.setdefault((holders[0], target), []).append(h)
        for (src, dst), hs in by_pair.items():
            self._replicating.update(hs)
            asyncio.get_running_loop().create_task(self._replicate(stores[src], stores[dst], hs))

    async def _replicate(self, src: Node, dst: Node, hashes: list[bytes]) -> None:
        try:
            n = await self.client(src.endpoints["store"]).replicate(hashes, dst.endpoints["store"])
            self.metrics.replications.inc(n)
            log.info("replicated %d hot blocks %s -> %s", n, src.node_id, dst.node_id)
        except StoreError as e:
            log.warning("replication %s -> %s failed: %s", src.node_id, dst.node_id, e)
        finally:
            self._replicating.difference_update(hashes)

    def client(self, endpoint: str) -> StoreClient:
        """The conductor's client of a store (its other commands to stores use it too)."""
        client = self._stores.get(endpoint)
        if client is None:
            client = self._stores[endpoint] = StoreClient(endpoint, curve=self.curve)
        client.term = self.term()
        return client

    def forget(self, endpoint: str) -> None:
        """A store died: drop its client."""
        client = self._stores.pop(endpoint, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        for c in self._stores.values():
            c.close()
        self._stores.clear()
