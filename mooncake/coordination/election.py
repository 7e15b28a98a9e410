"""Who leads: conductors campaign with etcd's election service, everyone else follows.

A conductor (``Candidate``) holds a lease of ``lease_ttl_s`` seconds, refreshed three times per
TTL, and campaigns under ``<prefix>/conductor`` with its name and endpoint; etcd answers the
campaign once it leads. If the lease cannot be refreshed for a whole TTL (etcd unreachable, the
process frozen) the lease has lapsed and another may lead: ``lost`` is set and the conductor
steps down. A clean shutdown revokes the lease, so a standby leads at once.

Frontends and workers (``LeaderWatch``) ask etcd who leads every ``poll_s`` and follow a change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

from mooncake.config import CoordinationConfig
from mooncake.coordination.etcd import Etcd, EtcdUnavailable

log = logging.getLogger(__name__)


def election_key(cfg: CoordinationConfig) -> bytes:
    return f"{cfg.prefix.rstrip('/')}/conductor".encode()


class Candidate:
    def __init__(self, cfg: CoordinationConfig, name: str, endpoint: str) -> None:
        self.cfg = cfg
        self.etcd = Etcd(cfg.etcd_endpoints)
        self.value = json.dumps({"name": name, "endpoint": endpoint}).encode()
        self.lease = ""
        self.lost = asyncio.Event()
        self._keepalive: asyncio.Task | None = None

    async def win(self) -> None:
        """Campaign until this conductor leads (standing by meanwhile; etcd may come and go)."""
        while True:
            try:
                self.lease = await self.etcd.grant(self.cfg.lease_ttl_s)
                self.lost.clear()
                self._keepalive = asyncio.create_task(self._keep())
                await self.etcd.campaign(election_key(self.cfg), self.lease, self.value)
                if not self.lost.is_set():
                    return
            except EtcdUnavailable as e:
                log.warning("campaign failed (%s); trying again", e)
            if self._keepalive is not None:
                self._keepalive.cancel()
            await asyncio.sleep(min(1.0, self.cfg.lease_ttl_s / 3))

    async def _keep(self) -> None:
        ttl = self.cfg.lease_ttl_s
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                left = await self.etcd.keepalive(self.lease)
            except EtcdUnavailable as e:
                left = -1
                log.warning("cannot refresh the conductor's lease: %s", e)
            if left > 0:
                refreshed = time.monotonic()
            elif left == 0 or time.monotonic() - refreshed >= ttl:
                log.error("the conductor's lease lapsed: another conductor may lead now")
                self.lost.set()
                return

    async def close(self) -> None:
        """Give the lead up at once (a standby need not wait out the lease)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.lease and not self.lost.is_set():
            try:
                await self.etcd.revoke(self.lease)
            except EtcdUnavailable:
                pass
        await self.etcd.close()


class LeaderWatch:
    """Follows the leading conductor: ``on_change(endpoint)`` whenever etcd names another."""

    def __init__(self, cfg: CoordinationConfig, on_change: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.cfg = cfg
        self.etcd = Etcd(cfg.etcd_endpoints)
        self.on_change = on_change
        self.leader: dict | None = None  # {"name", "endpoint"} of the one that leads

    async def current(self) -> dict | None:
        try:
            value = await self.etcd.leader(election_key(self.cfg))
        except EtcdUnavailable:
            return self.leader  # etcd away: the last one known
        return json.loads(value) if value else None

    async def first(self) -> str:
        """Wait until somebody leads; its endpoint."""
        while True:
            leader = await self.current()
            if leader is not None:
                self.leader = leader
                log.info("conductor %s leads (%s)", leader["name"], leader["endpoint"])
                return leader["endpoint"]
            await asyncio.sleep(self.cfg.poll_s)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_s)
            leader = await self.current()
            if leader is not None and leader != self.leader:
                log.warning("conductor %s leads now (%s)", leader["name"], leader["endpoint"])
                self.leader = leader
                if self.on_change is not None:
                    await self.on_change(leader["endpoint"])

    async def close(self) -> None:
        await self.etcd.close()
