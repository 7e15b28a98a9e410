"""Getting blocks onto disk, and keeping them there: the persistent tier's side of ``TieredStore``.

- write-through copies (``write_copies``, run by the ``WriteThrough`` thread): a copy of
  each put block is written to the persistent tier as it arrives;
- ``persist``: on graceful shutdown every block held above the persistent tier moves
  down into it, so a restart on the same directory hits;
- ``_flush``: the staged records are written; a full LMDB map lowers the tier's capacity to
  what it holds and evicts to make room (a retry), any other write failure (disk full)
  drops the blocks, counted, and the store serves on.

A mixin: the methods run on the store's own state under its lock.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .tiered import TieredStore

log = logging.getLogger(__name__)
PERSIST_BATCH = 64  # blocks per transaction when persisting on shutdown


class Durability:
    def write_copies(self: TieredStore, keys: Iterable[bytes]) -> int:
        """Write-through (the writer thread): copy those of ``keys`` still held above the persistent
        tier to it, in one transaction. Space is reserved under the store's lock (evicting the disk
        tier's LRU), the records are encoded and written without it, and settled under it again."""
        d = self._disk
        assert d is not None
        disk = self.tiers[d]
        items = []
        with self._lock:
            try:
                for key in keys:
                    i = self._where.get(key)
                    if i is None or i >= d or disk.has_copy(key):
                        continue
                    block = self.tiers[i].get(key)  # held here: its memory is not recycled meanwhile
                    if block is not None and self._make_room(d, block.nbytes) and disk.reserve_copy(key, block.nbytes):
                        items.append((key, block))
            finally:
                self._finish()
        if not items:
            return 0
        error = disk.write_records(items)
        with self._lock:
            disk.end_copies([k for k, _ in items], error)
        return 0 if error else len(items)

    def persist(self: TieredStore, deadline: float) -> tuple[int, int]:
        """Move every block held above the persistent tier down into it (graceful shutdown), least
        recently used first so that a full disk keeps the most recent, in batches (one transaction
        each) until ``deadline`` (``time.monotonic``). Ignores the admission gate. Returns (blocks
        moved, blocks left above)."""
        d, moved = self._disk, 0
        if d is None:
            return 0, 0
        for i in reversed(range(d)):
            while time.monotonic() < deadline:
                with self._lock:
                    try:
                        batch = [k for k, _ in zip(self._lru[i], range(PERSIST_BATCH))]
                        for key in batch:
                            block = self.tiers[i].get(key)
                            self._unlink(i, key)
                            if block is not None and self._insert(d, key, block, gated=False) is not None:
                                moved += 1
                            else:
                                self.stats.dropped += 1
                                self._forget(i, key)
                    finally:
                        self._finish()
                if not batch:
                    break
        return moved, sum(len(lru) for lru in self._lru[:d])

    def _flush(self: TieredStore, i: int) -> None:
        """Write tier ``i``'s staged blocks. A full LMDB map shrinks the tier's capacity to what
        it holds and the failed blocks go in again (evicting the LRU); any other failure drops them."""
        tier = self.tiers[i]
        full_before = tier.map_full
        failed = tier.flush()
        for key, _ in failed:
            if self._where.get(key) == i:
                self._lru[i].remove(key)
                del self._where[key]
        if failed and tier.map_full > full_before:
            tier.capacity_bytes = min(tier.capacity_bytes, tier.used_bytes)
            log.warning("LMDB tier capacity lowered to %d bytes (the map is full); evicting to make room",
                        tier.capacity_bytes)
            again = [(k, b) for k, b in failed if self._insert(i, k, b, gated=False) is None]
            failed = again + tier.flush()
            for key, _ in failed:
                if self._where.get(key) == i:
                    self._lru[i].remove(key)
                    del self._where[key]
        for key, _ in failed:
            if key not in self._where:
                self.stats.dropped += 1
                self._forget(i, key)
