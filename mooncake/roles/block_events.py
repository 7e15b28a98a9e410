"""What a role tells the conductor of the blocks it caches (an engine's device cache, a store's
tiers), batched: every ``FLUSH_S`` at most two messages per tier, whatever the traffic.

Between two flushes only each block's last event counts (stored, then evicted: evicted). A
flush sends every tier's ``removed`` before any ``stored``, so a block that moved between
tiers (evicted from one, stored in another) ends up indexed where it now is. The KV index the
conductor keeps is a hint (a block it lists that is gone is computed again), so a delay of
``FLUSH_S`` costs nothing but a hit now and then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable

from mooncake import protocol as P

log = logging.getLogger(__name__)
FLUSH_S = 0.02
KINDS = ("removed", "stored")  # the order a flush sends them in


class BlockEvents:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._last: dict[str, dict[bytes, str]] = {}  # tier -> block hash -> its last event since the flush

    def add(self, kind: str, tier: str, hashes: Iterable[bytes]) -> None:
        """Blocks ``stored`` in or ``removed`` from ``tier`` (call on the event loop)."""
        last = self._last.setdefault(tier, {})
        last.update(dict.fromkeys(hashes, kind))

    def take(self) -> list[P.BlockEvent]:
        """The messages for what happened since the last call (removals first)."""
        pending, self._last = self._last, {}
        out = []
        for kind in KINDS:
            for tier, last in pending.items():
                hashes = [h for h, k in last.items() if k == kind]
                if hashes:
                    out.append(P.BlockEvent(self.node_id, kind, tier, hashes))
        return out

    async def run(self, send: Callable[[P.BlockEvent], Awaitable[None]]) -> None:
        """Flush every ``FLUSH_S`` until cancelled."""
        while True:
            await asyncio.sleep(FLUSH_S)
            for msg in self.take():
                try:
                    await send(msg)
                except Exception:  # the next registration announces everything again
                    log.exception("sending block events failed")
