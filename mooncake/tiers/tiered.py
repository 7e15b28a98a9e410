"""TieredStore: an ordered list of tiers with LRU, demotion and promotion.

Each block lives in exactly one tier (tiers are exclusive). ``put`` writes to
the top tier; making room there evicts that tier's LRU block, which is demoted
to the next tier, and so on; eviction from the last tier drops the block and
emits a ``removed`` event. A hit in a lower tier moves the block back to the
top (``promote_on_hit``). Entry into a persistent (SSD) tier passes the
admission gate: ``on_demotion`` admits every block, ``after_hits`` only blocks
read at least ``ssd_admission_hits`` times, so one-shot traffic never touches
the disk; ``write_through`` also writes a copy of every put block to the
persistent tier as it arrives (``write_through.py``: a writer thread, batched),
so a crash loses at most the last batch; the copy is adopted when the block is
demoted, dropped when it leaves the store. ``persist`` moves every block held
above the persistent tier down into it (graceful shutdown: a restart hits).

Events: ``on_event(kind, tier, keys)`` with kind ``stored`` (the block is now in
``tier``: put, demotion, promotion) or ``removed`` (the block left this store;
``tier`` is the tier it left from). Called from the thread running the
operation, after the operation, batched by consecutive (kind, tier).

Thread safety: every method takes the store lock, except ``exists``, which only
reads the key index (atomic dict lookups under the GIL), so an event loop can
answer it while a worker thread does I/O.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import torch

from ..config import StoreConfig
from .base import StoredBlock, Tier
from .device import DeviceTier
from .dram import DramTier
from .lmdb_tier import LmdbTier
from .lru import LRU
from .stats import StoreStats
from .durability import Durability
from .write_through import WriteThrough

log = logging.getLogger(__name__)

EventSink = Callable[[str, str, list[bytes]], None]


class TieredStore(Durability):
    def __init__(self, tiers: Sequence[Tier], *, promote_on_hit: bool = True,
                 ssd_admission: Literal["on_demotion", "after_hits", "write_through"] = "on_demotion",
                 ssd_admission_hits: int = 1, on_event: EventSink | None = None) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        self.tiers = list(tiers)
        self.promote_on_hit = promote_on_hit
        self.ssd_admission = ssd_admission
        self.ssd_admission_hits = ssd_admission_hits
        self.on_event = on_event
        self.stats = StoreStats.for_tiers(names)
        self._lru = [LRU() for _ in self.tiers]
        self._where: dict[bytes, int] = {}
        self._lock = threading.RLock()
        self._events: list[tuple[str, str, bytes]] = []
        self._disk = next((i for i, t in enumerate(self.tiers) if t.persistent), None)
        self._recover()
        self.writer = WriteThrough(self.write_copies) \
            if ssd_admission == "write_through" and self._disk is not None else None

    @classmethod
    def from_config(cls, cfg: StoreConfig, node_id: str, device: torch.device | str | None = None,
                    on_event: EventSink | None = None) -> "TieredStore":
        """Tiers from ``cfg``: device (if device_bytes), DRAM (if dram_bytes), LMDB (if lmdb_bytes)
        in ``Path(cfg.data_dir) / node_id``. Use a node_id that is stable across restarts."""
        tiers: list[Tier] = []
        if cfg.device_bytes:
            tiers.append(DeviceTier(cfg.device_bytes, device))
        if cfg.dram_bytes:
            tiers.append(DramTier(cfg.dram_bytes))
        if cfg.lmdb_bytes:
            tiers.append(LmdbTier(Path(cfg.data_dir).expanduser() / node_id, cfg.lmdb_bytes))
        return cls(tiers, promote_on_hit=cfg.promote_on_hit, ssd_admission=cfg.ssd_admission,
                   ssd_admission_hits=cfg.ssd_admission_hits, on_event=on_event)

    # ---------------------------------------------------------------- internals

    def _recover(self) -> None:
        for i, tier in enumerate(self.tiers):
            for key in tier.keys():
                if key in self._where:  # a stale duplicate in a lower tier
                    tier.delete(key)
                    continue
                self._where[key] = i
                self._lru[i].add(key, tier.nbytes_of(key) or 0)
                self.stats.block_hits.setdefault(key, 0)
        with self._lock:
            for i, tier in enumerate(self.tiers):
                while tier.used_bytes > tier.capacity_bytes:  # capacity shrank since last run
                    victim = self._lru[i].oldest()
                    if victim is None:
                        break
                    self._evict(i, victim)
            self._finish()

    def _event(self, kind: str, tier: int, key: bytes) -> None:
        self._events.append((kind, self.tiers[tier].name, key))

    def _admitted(self, tier: int, key: bytes) -> bool:
        if not self.tiers[tier].persistent or self.ssd_admission != "after_hits":
            return True
        return self.stats.block_hits.get(key, 0) >= self.ssd_admission_hits

    def _make_room(self, i: int, nbytes: int) -> bool:
        tier = self.tiers[i]
        if nbytes > tier.capacity_bytes:
            return False
        while not tier.fits(nbytes):
            victim = self._lru[i].oldest()
            if victim is None:
                return False
            self._evict(i, victim)
        return True

    def _insert(self, start: int, key: bytes, block: StoredBlock, gated: bool = True) -> int | None:
        """Place ``block`` in the first tier from ``start`` that takes it; its index or None."""
        n = block.nbytes
        for j in range(start, len(self.tiers)):
            if gated and not self._admitted(j, key):
                return None
            tier = self.tiers[j]
            if (tier.has_copy(key) or self._make_room(j, n)) and tier.put(key, block):
                self._where[key] = j
                self._lru[j].add(key, n)
                self._event("stored", j, key)
                return j
        return None

    def _unlink(self, i: int, key: bytes) -> None:
        self._lru[i].remove(key)
        self.tiers[i].delete(key)
        del self._where[key]

    def _forget(self, i: int, key: bytes) -> None:
        if self._disk is not None:
            self.tiers[self._disk].drop_copy(key)
        self.stats.block_hits.pop(key, None)
        self._event("removed", i, key)

    def _evict(self, i: int, key: bytes) -> None:
        counters = self.stats.tiers[self.tiers[i].name]
        counters.evictions += 1
        nxt = i + 1
        block = None
        if nxt < len(self.tiers) and self._admitted(nxt, key):
            block = self.tiers[i].get(key)
        self._unlink(i, key)
        if block is not None and self._insert(nxt, key, block) is not None:
            counters.demotions += 1
            return
        self.stats.dropped += 1
        self._forget(i, key)

    def _finish(self) -> None:
        """Flush staged writes, then hand the operation's events to the sink."""
        if self._disk is not None:
            self._flush(self._disk)
        events, self._events = self._events, []
        if self.on_event is None or not events:
            return
        run: list[bytes] = []
        for n, (kind, tier, key) in enumerate(events):
            run.append(key)
            if n + 1 == len(events) or events[n + 1][:2] != (kind, tier):
                self.on_event(kind, tier, run)
                run = []

    # ---------------------------------------------------------------- object API

    def put_many(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor], model_id: str = "") -> int:
        """Store blocks (in the top tier that takes them); returns how many are now held."""
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys for {len(tensors)} tensors")
        held, copy = 0, []
        with self._lock:
            try:
                for key, t in zip(keys, tensors):
                    key = bytes(key)
                    i = self._where.get(key)
                    if i is not None:
                        self._unlink(i, key)  # replace: the new value wins, same key
                    if self._insert(0, key, StoredBlock(t, model_id)) is None:
                        self.stats.rejected += 1
                        if i is not None:
                            self._forget(i, key)
                        continue
                    self.stats.block_hits.setdefault(key, 0)
                    self.stats.stored += 1
                    held += 1
                    copy.append(key)
            finally:
                self._finish()
        if self.writer is not None and copy:
            self.writer.submit(copy)
        return held

    def get_many(self, keys: Iterable[bytes], prefix: bool = False,
                 count: bool = True) -> list[tuple[bytes, StoredBlock]]:
        """Found blocks in request order (``prefix``: stop at the first miss). Returned tensors
        are the store's own (read-only for the caller). ``count=False``: a replication read
        (no hit counting, no promotion)."""
        out: list[tuple[bytes, StoredBlock]] = []
        with self._lock:
            try:
                for key in keys:
                    key = bytes(key)
                    block = self._lookup(key, count)
                    if block is None:
                        if prefix:
                            break
                        continue
                    out.append((key, block))
            finally:
                self._finish()
        return out

    def _lookup(self, key: bytes, count: bool) -> StoredBlock | None:
        i = self._where.get(key)
        names = [t.name for t in self.tiers]
        if i is None:
            if count:
                self.stats.misses += 1
                for name in names:
                    self.stats.tiers[name].misses += 1
            return None
        block = self.tiers[i].get(key)
        if block is None:  # failed its check in the tier: already deleted there
            self._lru[i].remove(key)
            del self._where[key]
            self.stats.dropped += 1
            self._forget(i, key)
            return self._lookup(key, count)
        if not count:
            return block
        self.stats.hits += 1
        self.stats.block_hits[key] = self.stats.block_hits.get(key, 0) + 1
        for name in names[:i]:
            self.stats.tiers[name].misses += 1
        self.stats.tiers[names[i]].hits += 1
        if i > 0 and self.promote_on_hit:
            if i == self._disk and self.writer is not None:
                self.tiers[i].to_copy(key)  # write-through: its record stays as the copy
            self._unlink(i, key)
            j = self._insert(0, key, block)
            if j is None:
                self.stats.dropped += 1
                self._forget(i, key)
            elif j < i:
                self.stats.tiers[names[i]].promotions += 1
        else:
            self._lru[i].touch(key)
        return block

    def exists(self, keys: Iterable[bytes]) -> list[bool]:
        where = self._where
        return [bytes(k) in where for k in keys]

    def remove(self, keys: Iterable[bytes]) -> int:
        n = 0
        with self._lock:
            try:
                for key in keys:
                    key = bytes(key)
                    i = self._where.get(key)
                    if i is None:
                        continue
                    self._unlink(i, key)
                    self._forget(i, key)
                    self.stats.removed += 1
                    n += 1
            finally:
                self._finish()
        return n

    def tier_of(self, key: bytes) -> str | None:
        i = self._where.get(bytes(key))
        return None if i is None else self.tiers[i].name

    def stored(self) -> list[tuple[bytes, str]]:
        """Every held block with its tier (for announcing after (re)registration)."""
        with self._lock:
            return [(k, self.tiers[i].name) for k, i in self._where.items()]

    def snapshot(self, top_n: int = 10) -> dict[str, Any]:
        with self._lock:
            sizes = {t.name: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                              "blocks": len(self._lru[i])} for i, t in enumerate(self.tiers)}
            snap = self.stats.snapshot(sizes, top_n)
            snap["corrupt"] = sum(getattr(t, "corrupt", 0) for t in self.tiers)
            snap["disk_map_full"] = sum(getattr(t, "map_full", 0) for t in self.tiers)
            snap["disk_write_errors"] = sum(getattr(t, "write_errors", 0) for t in self.tiers)
            if self.writer is not None:
                snap["write_through"] = {"written": self.writer.written, "batches": self.writer.batches,
                                         "queued": self.writer.queued}
            return snap

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests, debugging)."""
        with self._lock:
            for i, tier in enumerate(self.tiers):
                lru = self._lru[i]
                copies = tier.copy_bytes if i == self._disk else 0
                assert tier.used_bytes == lru.total_bytes + copies, (tier.name, tier.used_bytes, lru.total_bytes)
                assert tier.used_bytes <= tier.capacity_bytes, (tier.name, tier.used_bytes)
                assert len(tier) == len(lru), (tier.name, len(tier), len(lru))
                for k in lru:
                    assert self._where.get(k) == i and tier.contains(k), (tier.name, k.hex())
            assert len(self._where) == sum(len(lru) for lru in self._lru)

    def close(self) -> None:
        if self.writer is not None:  # before the lock: the writer takes it for its last batch
            self.writer.close()
        with self._lock:
            for t in self.tiers:
                t.close()
