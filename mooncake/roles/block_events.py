"""What a role tells the conductor of the blocks it caches (an engine's device cache, a store's
tiers), gathered here and carried by the role's next heartbeat (``roles/conductor_link.py``): a role with
blocks to report sends its heartbeat early, on the next tick of ``REPORT_EVERY_S``
(``ticks.py``: the ticks every node's reports go on). So the conductor hears from a node at most
once a tick, however many blocks it stores, and an idle node wakes nobody between heartbeats.

Between two reports only each block's last event counts (stored, then evicted: evicted). A
report lists every tier's ``removed`` before any ``stored``, so a block that moved between
tiers (evicted from one, stored in another) ends up indexed where it now is. The KV index the
conductor keeps is a hint (a block it lists that is gone is computed again; one it does not list
yet is computed again too), so a delay of a tick costs nothing but a hit now and then.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from mooncake import protocol as P

KINDS = ("removed", "stored")  # the order a report lists them in


class BlockEvents:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._last: dict[str, dict[bytes, str]] = {}  # tier -> block hash -> its last event since the report
        self.pending = asyncio.Event()  # set while there is something to report

    def add(self, kind: str, tier: str, hashes: Iterable[bytes]) -> None:
        """Blocks ``stored`` in or ``removed`` from ``tier`` (call on the event loop)."""
        last = self._last.setdefault(tier, {})
        last.update(dict.fromkeys(hashes, kind))
        if last:
            self.pending.set()

    def take(self) -> list[P.BlockEvent]:
        """What happened since the last call, removals first."""
        pending, self._last = self._last, {}
        self.pending.clear()
        out = []
        for kind in KINDS:
            for tier, last in pending.items():
                hashes = [h for h, k in last.items() if k == kind]
                if hashes:
                    out.append(P.BlockEvent(self.node_id, kind, tier, hashes))
        return out
