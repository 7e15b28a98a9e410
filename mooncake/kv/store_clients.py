"""A worker's way to the stores: their clients (a small LRU) and KV written back in the background.

A failed write only costs reuse, and so does one dropped because ``max_pending_writes`` are
already in flight (a slow store must not make the worker hold KV copies without bound).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import torch

from mooncake.config import SecurityConfig
from mooncake.engine.sequence import Sequence
from mooncake.kv.integrity import Rejections, checksums
from mooncake.sched.request_class import FLEX_RANK, rank
from mooncake.security import Curve
from mooncake.tiers.client import StoreClient, StoreError, StoreUnavailable

log = logging.getLogger(__name__)
MAX_STORE_CLIENTS = 8  # stores a worker talks to at once: its node's and the replicas it reads

ExportFn = Callable[[Sequence, int, int], Awaitable["torch.Tensor | None"]]  # (seq, first, end) -> a copy of its KV (None: freed)


class StoreClients:
    def __init__(self, curve: Curve | None, max_message_bytes: int, rejections: Rejections | None,
                 security: SecurityConfig, model_id: str = "", node_id: str = "",
                 export: ExportFn | None = None) -> None:
        """``security``: read at each write (its ``max_pending_writes``); ``export``: a sequence's blocks
        (for ``save_blocks``)."""
        self._curve, self._max_message_bytes, self._rejections = curve, max_message_bytes, rejections
        self._security, self._model_id, self._node_id, self._export = security, model_id, node_id, export
        self._clients: dict[str, StoreClient] = {}
        self.writes: set[asyncio.Task] = set()  # write-backs in flight
        self.writes_dropped = 0  # write-backs dropped: max_pending_writes were in flight

    def client(self, endpoint: str) -> StoreClient:
        """The client of a store, kept in a small LRU: a restarted store comes back on a new
        endpoint, and the old client (its sockets and shared-memory segments) must not stay."""
        client = self._clients.pop(endpoint, None)
        if client is None:
            client = StoreClient(endpoint, curve=self._curve, max_message_bytes=self._max_message_bytes,
                                 on_corrupt=lambda n: self._rejections.add("checksum", n))  # type: ignore[union-attr]
        self._clients[endpoint] = client  # most recently used last
        while len(self._clients) > MAX_STORE_CLIENTS:
            self._clients.pop(next(iter(self._clients))).close()
        return client

    def __len__(self) -> int:
        return len(self._clients)

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self._clients

    def forget(self, endpoint: str, error: StoreError) -> None:
        """Drop the client of a store that stopped answering (it holds sockets and shm)."""
        if isinstance(error, StoreUnavailable):
            client = self._clients.pop(endpoint, None)
            if client is not None:
                client.close()

    async def save_blocks(self, endpoint: str, seq: Sequence, hashes: list[bytes], first: int, end: int) -> None:
        """Write ``seq``'s blocks ``[first, end)`` (keyed by ``hashes``) to a store (``write_back``)."""
        assert self._export is not None
        kv = await self._export(seq, first, end)
        if kv is not None:  # None: freed meanwhile
            self.write_back(endpoint, hashes, kv, rank(seq.sampling) == FLEX_RANK, seq.sampling.keep_s,
                            seq.sampling.tenant)

    def write_back(self, endpoint: str, hashes: list[bytes], kv: torch.Tensor, flex: bool = False,
                   keep_s: float = 0.0, tenant: str = "") -> None:
        """Put blocks into a store in the background (see the module docstring); ``flex``, ``keep_s``,
        ``tenant``: as ``StoreClient.put``'s."""
        if len(self.writes) >= self._security.max_pending_writes:
            self.writes_dropped += 1
            log.warning("%s: %d write-backs in flight, dropping %d blocks for %s (%d dropped so far)",
                        self._node_id, len(self.writes), len(hashes), endpoint, self.writes_dropped)
            return

        async def put() -> None:
            try:
                sums = await asyncio.to_thread(checksums, kv)
                await self.client(endpoint).put(hashes, kv, self._model_id, checksums=sums, flex=flex, keep_s=keep_s,
                                                tenant=tenant)
            except StoreError as e:
                log.warning("writing %d blocks to %s failed: %s", len(hashes), endpoint, e)
                self.forget(endpoint, e)

        task = asyncio.create_task(put())
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
