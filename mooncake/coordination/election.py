"""Who leads: conductors campaign with etcd's election service, everyone else follows.

A conductor (``Candidate``) holds a lease of ``lease_ttl_s`` seconds, refreshed three times per
TTL, and campaigns under ``<prefix>/conductor`` with its name and endpoint; etcd answers the
campaign once it leads, and a campaign wins only on that verified answer (etcd names this lease as
the leader's); a standby campaigns again every ``CAMPAIGN_TIMEOUT_S`` with the same lease. The
leader's ``term`` is etcd's revision of its campaign key (a later leader's is higher).

A leader acts only while its lease is proven: etcd counts a refreshed TTL from when the keepalive
reached it, never before it was sent, so the lease surely holds until ``proven_until`` = the
send time of the last keepalive answered + the TTL etcd answered - a margin. Every wait of the
keepalive ends by then; when it passes unproven (etcd unreachable, hung or answering nonsense, the
process frozen), or etcd answers that the lease is gone, ``lost`` is set — before etcd could expire
the lease and another lead — and ``on_lost`` is called in that same step; the keepalive sets it too
if it fails in any other way. A clean shutdown revokes the lease, so a standby leads at once.

Frontends and workers (``LeaderWatch``) ask etcd who leads every ``poll_s`` and follow a change;
whatever fails, the watch logs it and keeps following.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

from mooncake.config import CoordinationConfig
from mooncake.coordination.etcd import Etcd, EtcdTimedOut, EtcdUnavailable

log = logging.getLogger(__name__)

CAMPAIGN_TIMEOUT_S = 30.0  # a standby's campaign call is renewed this often (every etcd call has a limit)
WATCH_BACKOFF_S = 1.0  # after a failure, the leader watch waits this much more before asking again
KEEPALIVE_RETRY_S = 0.25  # a keepalive that failed is tried again this much later (not a third of a TTL)


def election_key(cfg: CoordinationConfig) -> bytes:
    return f"{cfg.prefix.rstrip('/')}/conductor".encode()


def lease_margin_s(ttl_s: float) -> float:
    """How long before its lease could lapse a leader stops acting (its event loop may notice late)."""
    return max(0.5, ttl_s / 5)


def proven_until(sent: float, ttl_s: float) -> float:
    """Until when a lease given ``ttl_s`` by a request sent at ``sent`` surely holds, less the margin."""
    return sent + ttl_s - lease_margin_s(ttl_s)


class Candidate:
    def __init__(self, cfg: CoordinationConfig, name: str, endpoint: str) -> None:
        self.cfg = cfg
        self.etcd = Etcd(cfg.etcd_endpoints)
        self.value = json.dumps({"name": name, "endpoint": endpoint}).encode()
        self.lease = ""
        self.term: int | None = None  # etcd's revision of the campaign key, once this leads
        self.proven_until = float("-inf")  # the lease surely holds until then (the event loop's time)
        self.lost = asyncio.Event()  # set when the lease is not proven: a leader must not act
        self.on_lost: Callable[[], None] | None = None  # called in the step that sets ``lost``
        self._keepalive: asyncio.Task | None = None

    def proven(self) -> bool:
        """Whether the lease surely holds now (a leader acts only while it does)."""
        return asyncio.get_running_loop().time() < self.proven_until

    async def win(self, same_lease: bool = False) -> bool:
        """Campaign until this conductor leads with its lease proven (True), standing by meanwhile
        (etcd may come and go); ``lost`` is clear then. A lease is kept while its keepalive runs:
        campaigning again with it resumes its place, and its term. ``same_lease`` (after ``lost``):
        only with the lease held, False once that is gone."""
        while True:
            try:
                if self._keepalive is None or self._keepalive.done():
                    if same_lease:
                        return False
                    sent = asyncio.get_running_loop().time()
                    self.lease = await self.etcd.grant(self.cfg.lease_ttl_s)
                    self.proven_until = proven_until(sent, self.cfg.lease_ttl_s)
                    self._keepalive = asyncio.create_task(self._keep())
                leader = await self.etcd.campaign(election_key(self.cfg), self.lease, self.value, CAMPAIGN_TIMEOUT_S)
                if self.proven():
                    self.term = int(leader["rev"])
                    self.lost.clear()
                    return True
            except EtcdTimedOut as e:
                log.debug("still standing by (%s)", e)
                continue
            except EtcdUnavailable as e:
                log.warning("campaign failed (%s); trying again", e)
            await asyncio.sleep(min(1.0, self.cfg.lease_ttl_s / 3))

    def _lose(self) -> None:
        if not self.lost.is_set():
            self.lost.set()
            if self.on_lost is not None:
                try:
                    self.on_lost()
                except Exception:
                    log.exception("stepping down failed")

    async def _keep(self) -> None:
        """Refresh the lease until etcd says it is gone; then, or if refreshing fails in any
        unforeseen way, ``lost`` is set (never a keepalive that stops while the conductor goes on
        leading)."""
        try:
            await self._refresh()
        except Exception:
            log.exception("the conductor's lease keepalive failed: stepping down")
        self._lose()

    async def _refresh(self) -> None:
        """A keepalive every third of the TTL (sooner after one that failed while proven), each
        proving the lease from when it was sent; ``lost`` is set as ``proven_until`` passes, and no
        wait here outlasts it (a hung etcd cannot hold a leader past it). Not proven, it goes on
        trying: the lease may be proven again. Returns once etcd says the lease is gone."""
        loop = asyncio.get_running_loop()
        interval = self.cfg.lease_ttl_s / 3
        pause = interval
        while True:
            left_s = self.proven_until - loop.time()
            await asyncio.sleep(min(pause, left_s) if left_s > 0 else pause)
            sent = loop.time()
            if sent >= self.proven_until:
                self._unproven()
            try:
                left = await asyncio.wait_for(self.etcd.keepalive(self.lease, timeout_s=interval),
                                              self.proven_until - sent if self.proven_until > sent else None)
            except asyncio.TimeoutError:  # proven_until passed while etcd did not answer
                left = -1
            except EtcdUnavailable as e:
                left = -1
                log.warning("cannot refresh the conductor's lease: %s", e)
            if left == 0:
                log.error("the conductor's lease lapsed: another conductor may lead now")
                return
            if left > 0:
                self.proven_until = max(self.proven_until, proven_until(sent, left))
            elif not self.proven():
                self._unproven()
            pause = interval if left > 0 or not self.proven() else min(KEEPALIVE_RETRY_S, interval)

    def _unproven(self) -> None:
        if not self.lost.is_set():
            log.error("the conductor's lease is not proven: a leader stops acting before etcd could expire it")
        self._lose()

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
