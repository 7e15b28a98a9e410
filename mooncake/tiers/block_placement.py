"""Where each block of a ``TieredStore`` lives, and the moves between its tiers.

``Placement`` holds the tiers, each tier's LRU order, the key -> tier index, the store's counters
and its lock, and makes the moves every store operation is built of:

- ``insert``: the block goes into the first tier from ``start`` that takes it (making room there
  by eviction: blocks only flex requests wrote go first, those a session keeps last, and a block
  displaces only blocks of its own class or one evicted before it: a flex scan never pushes out
  an interactive prefix, nor other blocks a session's); entry into a persistent tier passes the
  admission gate unless ``gated=False``;
- ``evict``: a tier's block is demoted to the next tier when admitted there, else dropped;
- ``unlink`` takes a block out of its tier; ``forget`` records that it left the store (its
  write-through copy and hit count go, a ``removed`` event is queued);
- ``keep`` records that a session's tenant keeps a block (``kept``, ``keeper``); ``order`` puts a
  block in its tier's LRU order, where past ``session_blocks_per_key`` blocks kept in the whole
  store (``keepers``, shared by the tiers) a tenant's oldest kept ones become ordinary;
- ``finish`` ends an operation: the disk tier's staged writes are flushed, then the queued
  events go to ``on_event``, batched by consecutive (kind, tier).

A flush that fails fails soft: a full LMDB map lowers the tier's capacity to what it holds and
evicts to make room (a retry); any other write failure (disk full) drops the blocks, counted, and
the store serves on. The caller holds ``lock`` around its moves and calls ``finish`` at the end.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from .base import StoredBlock, Tier
from ..tenant_quota import TenantQuota
from .lru import LRU
from .persistent import PersistentTier, persistent_index
from .stats import StoreStats

log = logging.getLogger(__name__)

EventSink = Callable[[str, str, list[bytes]], None]


FLEX, OTHER, KEPT = range(3)  # eviction classes, evicted first to last


class Placement:
    def __init__(self, tiers: Sequence[Tier], ssd_admission: str, ssd_admission_hits: int,
                 on_event: EventSink | None, keepers: TenantQuota[bytes] | None = None) -> None:
        """``keepers``: what each tenant may keep in the whole store (``tenant_quota.py``; its capacity
        in blocks is the tiers' bytes over the size of the block being kept)."""
        self.tiers = list(tiers)
        self.ssd_admission = ssd_admission
        self.ssd_admission_hits = ssd_admission_hits
        self.on_event = on_event
        self.stats = StoreStats.for_tiers([t.name for t in self.tiers])
        self.keepers: TenantQuota[bytes] = keepers if keepers is not None else TenantQuota()  # of the kept blocks, all tiers
        self.capacity_bytes = sum(t.capacity_bytes for t in self.tiers)
        self.lru = [LRU(keepers=self.keepers) for _ in self.tiers]
        self.where: dict[bytes, int] = {}
        self.flex: set[bytes] = set()  # blocks only flex requests wrote: evicted first in every tier
        self.kept: dict[bytes, float] = {}  # blocks a session keeps -> until when: evicted last in every tier
        self.keeper: dict[bytes, str] = {}  # of ``kept``: the tenant that kept it last (its quota counts it)
        self.lock = threading.RLock()
        self.disk = persistent_index(self.tiers)  # the persistent tier's index, None without one
        self.persistent: PersistentTier | None = self.tiers[self.disk] if self.disk is not None else None  # type: ignore[assignment]
        self._events: list[tuple[str, str, bytes]] = []

    def recover(self) -> None:
        """Index the blocks the tiers already hold (a restart), then evict what exceeds a capacity."""
        for i, tier in enumerate(self.tiers):
            for key in tier.keys():
                if key in self.where:  # a stale duplicate in a lower tier
                    tier.delete(key)
                    continue
                self.where[key] = i
                self.lru[i].add(key, tier.nbytes_of(key) or 0)
                self.stats.block_hits.setdefault(key, 0)
        with self.lock:
            for i, tier in enumerate(self.tiers):
                while tier.used_bytes > tier.capacity_bytes:  # capacity shrank since last run
                    victim = self.lru[i].oldest()
                    if victim is None:
                        break
                    self.evict(i, victim)
            self.finish()

    def _event(self, kind: str, tier: int, key: bytes) -> None:
        self._events.append((kind, self.tiers[tier].name, key))

    def admitted(self, tier: int, key: bytes) -> bool:
        if tier != self.disk or self.ssd_admission != "after_hits":
            return True
        return self.stats.block_hits.get(key, 0) >= self.ssd_admission_hits

    def level(self, key: bytes) -> int:
        """A block's eviction class: FLEX (evicted first), OTHER, or KEPT by a session (last)."""
        if key in self.flex:
            return FLEX
        return KEPT if self.kept.get(key, 0.0) > time.monotonic() else OTHER

    def make_room(self, i: int, nbytes: int, level: int = KEPT) -> bool:
        """Evict from tier ``i`` until ``nbytes`` fit (flex blocks first, kept ones last), for a
        block of eviction class ``level``, which displaces only blocks of its class or below
        (else it goes to the next tier)."""
        tier = self.tiers[i]
        if nbytes > tier.capacity_bytes:
            return False
        while not tier.fits(nbytes):
            victim = self.lru[i].oldest()
            if victim is None or self.level(victim) > level:
                return False
            self.evict(i, victim)
        return True

    def insert(self, start: int, key: bytes, block: StoredBlock, gated: bool = True) -> int | None:
        """Place ``block`` in the first tier from ``start`` that takes it; its index or None."""
        n = block.nbytes
        for j in range(start, len(self.tiers)):
            if gated and not self.admitted(j, key):
                return None
            tier = self.tiers[j]
            if (tier.has_copy(key) or self.make_room(j, n, self.level(key))) and tier.put(key, block):
                self.where[key] = j
                self.order(j, key, n)
                self._event("stored", j, key)
                return j
        return None

    def order(self, i: int, key: bytes, nbytes: int) -> None:
        """Add held ``key`` to tier ``i``'s LRU order by its class; the blocks its keeper's quota
        makes ordinary (in any tier) are kept no longer."""
        self.keepers.capacity = self.capacity_bytes // max(1, nbytes)
        for old in self.lru[i].add(key, nbytes, key in self.flex, self.kept.get(key, 0.0), self.keeper.get(key, "")):
            self.unkeep(old)
            self.lru[self.where[old]].stop_keeping(old)

    def keep(self, key: bytes, until: float, tenant: str) -> None:
        """``tenant`` keeps ``key`` until ``until`` or later (the latest time asked wins)."""
        self.kept[key] = max(until, self.kept.get(key, 0.0))
        self.keeper[key] = tenant

    def unkeep(self, key: bytes) -> None:
        self.kept.pop(key, None)
        self.keeper.pop(key, None)

    def unlink(self, i: int, key: bytes) -> None:
        self.lru[i].remove(key)
        self.tiers[i].delete(key)
        del self.where[key]

    def forget(self, i: int, key: bytes) -> None:
        self.flex.discard(key)
        self.unkeep(key)
        if self.persistent is not None:
            self.persistent.drop_copy(key)
        self.stats.block_hits.pop(key, None)
        self._event("removed", i, key)

    def evict(self, i: int, key: bytes) -> None:
        counters = self.stats.tiers[self.tiers[i].name]
        counters.evictions += 1
        counters.flex_evictions += key in self.flex
        nxt = i + 1
        block = None
        if nxt < len(self.tiers) and self.admitted(nxt, key):
            block = self.tiers[i].get(key)
        self.unlink(i, key)
        if block is not None and self.insert(nxt, key, block) is not None:
            counters.demotions += 1
            return
        self.stats.dropped += 1
        self.forget(i, key)

    def finish(self) -> None:
        """Flush staged writes, then hand the operation's events to the sink."""
        if self.disk is not None:
            self._flush()
        events, self._events = self._events, []
        if self.on_event is None or not events:
            return
        run: list[bytes] = []
        for n, (kind, tier, key) in enumerate(events):
            run.append(key)
            if n + 1 == len(events) or events[n + 1][:2] != (kind, tier):
                self.on_event(kind, tier, run)
                run = []

    def _flush(self) -> None:
        """Write the persistent tier's staged blocks. A full medium (LMDB's map) shrinks the tier's
        capacity to what it holds and the failed blocks go in again (evicting the LRU); any other
        failure drops them."""
        i, tier = self.disk, self.persistent
        assert i is not None and tier is not None
        full_before = tier.map_full
        failed = tier.flush()
        for key, _ in failed:
            if self.where.get(key) == i:
                self.lru[i].remove(key)
                del self.where[key]
        if failed and tier.map_full > full_before:
            tier.capacity_bytes = min(tier.capacity_bytes, tier.used_bytes)
            log.warning("LMDB tier capacity lowered to %d bytes (the map is full); evicting to make room",
                        tier.capacity_bytes)
            again = [(k, b) for k, b in failed if self.insert(i, k, b, gated=False) is None]
            failed = again + tier.flush()
            for key, _ in failed:
                if self.where.get(key) == i:
                    self.lru[i].remove(key)
                    del self.where[key]
        for key, _ in failed:
            if key not in self.where:
                self.stats.dropped += 1
                self.forget(i, key)

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests, debugging)."""
        with self.lock:
            for i, tier in enumerate(self.tiers):
                lru = self.lru[i]
                copies = self.persistent.copy_bytes if tier is self.persistent else 0  # type: ignore[union-attr]
                assert tier.used_bytes == lru.total_bytes + copies, (tier.name, tier.used_bytes, lru.total_bytes)
                assert tier.used_bytes <= tier.capacity_bytes, (tier.name, tier.used_bytes)
                assert len(tier) == len(lru), (tier.name, len(tier), len(lru))
                for k in lru:
                    assert self.where.get(k) == i and tier.contains(k), (tier.name, k.hex())
                lru.check()
            kept = sum(lru.kept_blocks() for lru in self.lru)  # (those due expire first)
            owners = self.keepers.owners()  # the kept blocks of every tier, each of the tenant that kept it last
            assert len(owners) == kept
            assert all(self.keeper.get(k) == t for k, t in owners.items()) and set(self.keeper) <= set(self.kept)
            assert len(self.where) == sum(len(lru) for lru in self.lru)
