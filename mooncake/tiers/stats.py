"""Store counters, kept incrementally in one place (``StoreStats``)."""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TierCounters:
    hits: int = 0  # lookups answered by this tier
    misses: int = 0  # lookups that passed this tier without finding the block
    evictions: int = 0  # blocks pushed out of this tier to make room
    flex_evictions: int = 0  # of them, blocks only flex requests wrote (``sched/request_class.py``)
    promotions: int = 0  # blocks moved from this tier up to the top tier on a hit
    demotions: int = 0  # evicted blocks that went on to the next tier (not dropped)


@dataclass
class StoreStats:
    tiers: dict[str, TierCounters]
    hits: int = 0  # blocks found (any tier)
    misses: int = 0  # blocks looked up and found nowhere
    stored: int = 0  # blocks accepted by put
    dropped: int = 0  # blocks that left the store by eviction
    removed: int = 0  # blocks removed on request
    rejected: int = 0  # blocks a put could not place anywhere (or gated off SSD)
    block_hits: dict[bytes, int] = field(default_factory=dict)  # per resident block

    @classmethod
    def for_tiers(cls, names: list[str]) -> "StoreStats":
        return cls(tiers={n: TierCounters() for n in names})

    def hot(self, n: int = 10) -> list[tuple[bytes, int]]:
        return [kv for kv in heapq.nlargest(n, self.block_hits.items(), key=lambda kv: kv[1]) if kv[1] > 0]

    def snapshot(self, tier_sizes: dict[str, dict[str, int]], top_n: int = 10) -> dict[str, Any]:
        return {
            "hits": self.hits, "misses": self.misses, "stored": self.stored,
            "dropped": self.dropped, "removed": self.removed, "rejected": self.rejected,
            "tiers": [{"name": name, **tier_sizes[name], **asdict(c)} for name, c in self.tiers.items()],
            "hot": [[k.hex(), h] for k, h in self.hot(top_n)],
        }
