"""Who leads: conductors campaign with etcd's election service, everyone else follows.

A conductor (``Candidate``) holds a lease of ``lease_ttl_s`` seconds, refreshed three times per
TTL, and campaigns under ``<prefix>/conductor`` with its name and endpoint; etcd answers the
campaign once it leads, and a campaign wins only on that verified answer (etcd names this lease as
the leader's); a standby campaigns again every ``CAMPAIGN_TIMEOUT_S`` with the same lease. If the
lease cannot be refreshed for a whole TTL (etcd unreachable or answering nonsense, the process
frozen) the lease has lapsed and another may lead: ``lost`` is set and the conductor steps down;
the keepalive sets it too if it fails in any other way. A clean shutdown revokes the lease, so a
standby leads at once.

Frontends and workers (``LeaderWatch``) ask etcd who leads every ``poll_s`` and follow a change;
whatever fails, the watch logs it and keeps following.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable

from mooncake.config import CoordinationConfig
from mooncake.coordination.etcd import Etcd, EtcdTimedOut, EtcdUnavailable

log = logging.getLogger(__name__)

CAMPAIGN_TIMEOUT_S = 30.0  # a standby's campaign call is renewed this often (every etcd call has a limit)
WATCH_BACKOFF_S = 1.0  # after a failure, the leader watch waits this much more before asking again


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
        """Campaign until this conductor leads (standing by meanwhile; etcd may come and go). A
        lease is kept while its keepalive runs: campaigning again with it resumes its place."""
        while True:
            try:
                if self._keepalive is None or self._keepalive.done():
                    self.lease = await self.etcd.grant(self.cfg.lease_ttl_s)
                    self.lost.clear()
                    self._keepalive = asyncio.create_task(self._keep())
                await self.etcd.campaign(election_key(self.cfg), self.lease, self.value, CAMPAIGN_TIMEOUT_S)
                if not self.lost.is_set():
                    return
            except EtcdTimedOut as e:
                log.debug("still standing by (%s)", e)
                continue
            except EtcdUnavailable as e:
                log.warning("campaign failed (%s); trying again", e)
            await asyncio.sleep(min(1.0, self.cfg.lease_ttl_s / 3))

    async def _keep(self) -> None:
        """Refresh the lease until it lapses; then, or if refreshing fails in any unforeseen way,
        ``lost`` is set (never a keepalive that stops while the conductor goes on leading)."""
        try:
            await self._refresh()
        except Exception:
            log.exception("the conductor's lease keepalive failed: stepping down")
        self.lost.set()

    async def _refresh(self) -> None:
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
        """Who leads ({"name", "endpoint"}); None: nobody. etcd away, or naming a leader in a way
        this cannot read: the last one known."""
        try:
            value = await self.etcd.leader(election_key(self.cfg))
        except EtcdUnavailable as e:
            log.debug("cannot ask etcd who leads: %s", e)
            return self.leader
        if not value:
            return None
        try:
            leader = json.loads(value)
            if isinstance(leader, dict) and isinstance(leader.get("name"), str) \
                    and isinstance(leader.get("endpoint"), str) and leader["endpoint"]:
                return leader
        except ValueError:
            pass
        log.warning("etcd names a leader this cannot read: %r", value[:200])
        return self.leader

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
        """Follow the leader for good: a failure (of etcd, or of ``on_change``) is logged, and the
        watch asks again after a backoff (a change not followed yet is followed then)."""
        while True:
            await asyncio.sleep(self.cfg.poll_s)
            try:
                leader = await self.current()
                if leader is not None and leader != self.leader:
                    log.warning("conductor %s leads now (%s)", leader["name"], leader["endpoint"])
                    if self.on_change is not None:
                        await self.on_change(leader["endpoint"])
                    self.leader = leader
            except Exception:
                log.exception("the leader watch failed; it asks again in %.0fs", WATCH_BACKOFF_S)
                await asyncio.sleep(WATCH_BACKOFF_S)

    async def close(self) -> None:
        await self.etcd.close()
