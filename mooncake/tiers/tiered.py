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

The store is the object API (put, get with hit counting and promotion, remove,
stats) over its ``Placement`` (``block_placement.py``: which tier holds each block,
and the moves between tiers); its ``Durability`` (``durability.py``) writes the
write-through copies and persists on shutdown.

Events: ``on_event(kind, tier, keys)`` with kind ``stored`` (the block is now in
``tier``: put, demotion, promotion) or ``removed`` (the block left this store;
``tier`` is the tier it left from). Called from the thread running the
operation, after the operation, batched by consecutive (kind, tier).

Thread safety: every method takes the store lock, except ``exists``, which only
reads the key index (atomic dict lookups under the GIL), so an event loop can
answer it while a worker thread does I/O.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import torch

from ..config import StoreConfig
from ..tenant_quota import TenantQuota
from .base import StoredBlock, Tier
from .memory import DeviceTier, DramTier
from .durability import Durability
from .lmdb_tier import LmdbTier
from .block_placement import EventSink, Placement
from .timing import MAX_KEEP_S
from .write_through import WriteThrough


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], *, promote_on_hit: bool = True,
                 ssd_admission: Literal["on_demotion", "after_hits", "write_through"] = "on_demotion",
                 ssd_admission_hits: int = 1, on_event: EventSink | None = None,
                 session_blocks_per_key: int = 0, session_share_per_key: float = 0.0) -> None:
        """``session_blocks_per_key``, ``session_share_per_key`` (of the store's capacity): what one
        tenant may keep at once in the store, all tiers (``tenant_quota.py``; 0: no limit)."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        self.promote_on_hit = promote_on_hit
        self.placement = Placement(tiers, ssd_admission, ssd_admission_hits, on_event,
                                   TenantQuota(session_blocks_per_key, session_share_per_key))
        self.tiers = self.placement.tiers
        self.stats = self.placement.stats
        self.durability = Durability(self.placement)
        self.placement.recover()
        self.writer = WriteThrough(self.durability.write_copies) \
            if ssd_admission == "write_through" and self.placement.disk is not None else None

    @property
    def on_event(self) -> EventSink | None:
        return self.placement.on_event

    @on_event.setter
    def on_event(self, sink: EventSink | None) -> None:
        self.placement.on_event = sink

    @classmethod
    def from_config(cls, cfg: StoreConfig, node_id: str, device: torch.device | str | None = None,
                    on_event: EventSink | None = None, session_blocks_per_key: int = 0,
                    session_share_per_key: float = 0.0) -> "TieredStore":
        """Tiers from ``cfg``: device (if device_bytes), DRAM (if dram_bytes), LMDB (if lmdb_bytes)
        in ``Path(cfg.data_dir) / node_id``. Use a node_id that is stable across restarts.
        ``session_blocks_per_key``, ``session_share_per_key``: ``[classes]``'s."""
        tiers: list[Tier] = []
        if cfg.device_bytes:
            tiers.append(DeviceTier(cfg.device_bytes, device))
        if cfg.dram_bytes:
            tiers.append(DramTier(cfg.dram_bytes))
        if cfg.lmdb_bytes:
            tiers.append(LmdbTier(Path(cfg.data_dir).expanduser() / node_id, cfg.lmdb_bytes))
        return cls(tiers, promote_on_hit=cfg.promote_on_hit, ssd_admission=cfg.ssd_admission,
                   ssd_admission_hits=cfg.ssd_admission_hits, on_event=on_event,
                   session_blocks_per_key=session_blocks_per_key, session_share_per_key=session_share_per_key)

    # ---------------------------------------------------------------- object API

    def put_many(self, keys: Sequence[bytes], tensors: Sequence[torch.Tensor], model_id: str = "",
                 checksums: Sequence[int] = (), flex: bool = False, keep_s: float = 0.0, tenant: str = "") -> int:
        """Store blocks (in the top tier that takes them) with the checksums their writer sent
        (none: 0, not known); returns how many are now held. ``flex``: a flex request wrote them
        (they are evicted first, in every tier, unless another request writes them too);
        ``keep_s``: a session's request of ``tenant`` wrote them, to be kept that long (evicted
        last until then, within the tenant's quota)."""
        until = _until(keep_s)
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys for {len(tensors)} tensors")
        sums = checksums if len(checksums) == len(keys) else [0] * len(keys)
        held, copy = 0, []
        with self.placement.lock:
            try:
                for key, t, sent in zip(keys, tensors, sums):
                    key = bytes(key)
                    i = self.placement.where.get(key)
                    if flex and not until and (i is None or key in self.placement.flex):
                        self.placement.flex.add(key)
                    else:
                        self.placement.flex.discard(key)
                    if until:
                        self.placement.keep(key, until, tenant)
                    if i is not None:
                        self.placement.unlink(i, key)  # replace: the new value wins, same key
                    if self.placement.insert(0, key, StoredBlock(t, model_id, sent)) is None:
                        self.stats.rejected += 1
                        if i is not None:
                            self.placement.forget(i, key)
                        self.placement.flex.discard(key)
                        self.placement.unkeep(key)
                        continue
                    self.stats.block_hits.setdefault(key, 0)
                    self.stats.stored += 1
                    held += 1
                    copy.append(key)
            finally:
                self.placement.finish()
        if self.writer is not None and copy:
            self.writer.submit(copy)
        return held

    def get_many(self, keys: Iterable[bytes], prefix: bool = False,
                 count: bool = True) -> list[tuple[bytes, StoredBlock]]:
        """Found blocks in request order (``prefix``: stop at the first miss). Returned tensors
        are the store's own (read-only for the caller). ``count=False``: a replication read
        (no hit counting, no promotion)."""
        out: list[tuple[bytes, StoredBlock]] = []
        with self.placement.lock:
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
                self.placement.finish()
        return out

    def _lookup(self, key: bytes, count: bool) -> StoredBlock | None:
        i = self.placement.where.get(key)
        names = [t.name for t in self.tiers]
        if i is None:
            if count:
                self.stats.misses += 1
                for name in names:
                    self.stats.tiers[name].misses += 1
            return None
        block = self.tiers[i].get(key)
        if block is None:  # failed its check in the tier: already deleted there
            self.placement.lru[i].remove(key)
            del self.placement.where[key]
            self.stats.dropped += 1
            self.placement.forget(i, key)
            return self._lookup(key, count)
        if not count:
            return block
        self.stats.hits += 1
        self.stats.block_hits[key] = self.stats.block_hits.get(key, 0) + 1
        for name in names[:i]:
            self.stats.tiers[name].misses += 1
        self.stats.tiers[names[i]].hits += 1
        if i > 0 and self.promote_on_hit:
            if i == self.placement.disk and self.writer is not None:
                self.placement.persistent.to_copy(key)  # type: ignore[union-attr]  # write-through: its record stays as the copy
            self.placement.unlink(i, key)
            j = self.placement.insert(0, key, block)
            if j is None:
                self.stats.dropped += 1
                self.placement.forget(i, key)
            elif j < i:
                self.stats.tiers[names[i]].promotions += 1
        else:
            self.placement.lru[i].touch(key)
        return block

    def keep(self, keys: Iterable[bytes], keep_s: float, tenant: str = "") -> int:
        """Keep the held blocks of ``keys`` for ``keep_s`` from now (a session's prefix: evicted
        last, in every tier, until then), for ``tenant`` (within its quota); how many are held."""
        until, held = _until(keep_s), 0
        with self.placement.lock:
            for key in map(bytes, keys):
                i = self.placement.where.get(key)
                if i is None:
                    continue
                held += 1
                if until:
                    self.placement.keep(key, until, tenant)
                    self.placement.flex.discard(key)
                    self.placement.order(i, key, self.placement.lru[i].remove(key))
        return held

    def exists(self, keys: Iterable[bytes]) -> list[bool]:
        where = self.placement.where
        return [bytes(k) in where for k in keys]

    def remove(self, keys: Iterable[bytes]) -> int:
        n = 0
        with self.placement.lock:
            try:
                for key in keys:
                    key = bytes(key)
                    i = self.placement.where.get(key)
                    if i is None:
                        continue
                    self.placement.unlink(i, key)
                    self.placement.forget(i, key)
                    self.stats.removed += 1
                    n += 1
            finally:
                self.placement.finish()
        return n

    def tier_of(self, key: bytes) -> str | None:
        i = self.placement.where.get(bytes(key))
        return None if i is None else self.tiers[i].name

    def stored(self) -> list[tuple[bytes, str]]:
        """Every held block with its tier (for announcing after (re)registration)."""
        with self.placement.lock:
            return [(k, self.tiers[i].name) for k, i in self.placement.where.items()]

    def snapshot(self, top_n: int = 10) -> dict[str, Any]:
        with self.placement.lock:
            sizes = {t.name: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                              "blocks": len(self.placement.lru[i]), "flex_blocks": self.placement.lru[i].flex_blocks(),
                              "session_blocks": self.placement.lru[i].kept_blocks()}
                     for i, t in enumerate(self.tiers)}
            snap = self.stats.snapshot(sizes, top_n)
            snap["kept_by_tenant"] = self.placement.keepers.counts()  # all tiers (expired ones gone: sizes)
            snap["corrupt"] = sum(getattr(t, "corrupt", 0) for t in self.tiers)
            snap["disk_map_full"] = sum(getattr(t, "map_full", 0) for t in self.tiers)
            snap["disk_write_errors"] = sum(getattr(t, "write_errors", 0) for t in self.tiers)
            if self.writer is not None:
                snap["write_through"] = {"written": self.writer.written, "batches": self.writer.batches,
                                         "queued": self.writer.queued, "dropped": self.writer.dropped}
            return snap

    def persist(self, deadline: float) -> tuple[int, int]:
        """Move every block held above the persistent tier down into it (graceful shutdown) until
        ``deadline`` (``time.monotonic``); returns (blocks moved, blocks left above)."""
        return self.durability.persist(deadline)

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests, debugging)."""
        self.placement.check_invariants()

    def close(self) -> None:
        if self.writer is not None:  # before the lock: the writer takes it for its last batch
            self.writer.close()
        with self.placement.lock:
            for t in self.tiers:
                t.close()


def _until(keep_s: float) -> float:
    """When blocks kept ``keep_s`` from now are due (0.0: not kept)."""
    return time.monotonic() + min(keep_s, MAX_KEEP_S) if keep_s > 0 else 0.0
