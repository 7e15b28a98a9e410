"""Getting blocks onto the persistent tier, and keeping them there.

- write-through copies (``write_copies``, run by the ``WriteThrough`` thread): a copy of
  each put block is written to the persistent tier as it arrives;
- ``persist``: on graceful shutdown every block held above the persistent tier moves
  down into it, so a restart on the same directory hits.

Both work on the store's ``Placement``, under its lock.
"""

from __future__ import annotations

import time
from typing import Iterable

from .block_placement import Placement

PERSIST_BATCH = 64  # blocks per transaction when persisting on shutdown


class Durability:
    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def write_copies(self, keys: Iterable[bytes]) -> int:
        """Write-through (the writer thread): copy those of ``keys`` still held above the persistent
        tier to it, in one transaction. Space is reserved under the store's lock (evicting the disk
        tier's LRU), the records are encoded and written without it, and settled under it again."""
        p = self.placement
        d, disk = p.disk, p.persistent
        assert d is not None and disk is not None
        items = []
        with p.lock:
            try:
                for key in keys:
                    i = p.where.get(key)
                    if i is None or i >= d or disk.has_copy(key):
                        continue
                    block = p.tiers[i].get(key)  # held here: its memory is not recycled meanwhile
                    if block is not None and p.make_room(d, block.nbytes, p.level(key)) and disk.reserve_copy(key, block.nbytes):
                        items.append((key, block))
            finally:
                p.finish()
        if not items:
            return 0
        error = disk.write_records(items)
        with p.lock:
            disk.end_copies([k for k, _ in items], error)
        return 0 if error else len(items)

    def persist(self, deadline: float) -> tuple[int, int]:
        """Move every block held above the persistent tier down into it (graceful shutdown), least
        recently used first so that a full disk keeps the most recent, in batches (one transaction
        each) until ``deadline`` (``time.monotonic``). Ignores the admission gate. Returns (blocks
        moved, blocks left above)."""
        p = self.placement
        d, moved = p.disk, 0
        if d is None:
            return 0, 0
        for i in reversed(range(d)):
            while time.monotonic() < deadline:
                with p.lock:
                    try:
                        batch = [k for k, _ in zip(p.lru[i], range(PERSIST_BATCH))]
                        for key in batch:
                            block = p.tiers[i].get(key)
                            p.unlink(i, key)
                            if block is not None and p.insert(d, key, block, gated=False) is not None:
                                moved += 1
                            else:
                                p.stats.dropped += 1
                                p.forget(i, key)
                    finally:
                        p.finish()
                if not batch:
                    break
        return moved, sum(len(lru) for lru in p.lru[:d])
