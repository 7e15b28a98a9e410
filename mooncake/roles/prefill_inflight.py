"""The prompt blocks a prefill instance is computing right now, and who computes them.

The conductor plans a request behind another on the same prefill instance with the
blocks that one will compute counted as cached (``mooncake.sched.booking.PendingBlocks``).
But the instance runs up to ``max_prefill_batch`` prompts at once: a request that starts
while the one ahead is still computing their shared prefix would find only the chunks done
so far in the cache and compute the rest again, alongside it — twice the work for the
prefix, both first tokens later, and a TTFT far over the conductor's prediction. Instead it
waits for the request that computes its next block, then takes the blocks from the cache.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from mooncake.blocks import BlockHash


class InflightBlocks:
    def __init__(self) -> None:
        self._computer: dict[BlockHash, str] = {}  # block -> the request computing it
        self._claims: dict[str, tuple[list[BlockHash], asyncio.Event]] = {}  # request -> its blocks, done

    def computing(self, hashes: Sequence[BlockHash], have: int) -> asyncio.Event | None:
        """Set once the request computing ``hashes[have]`` (the first block not cached) is done
        with its prefill; None if no running request computes it."""
        if have >= len(hashes):
            return None
        req_id = self._computer.get(hashes[have])
        return self._claims[req_id][1] if req_id is not None else None

    def start(self, req_id: str, hashes: Sequence[BlockHash], have: int) -> None:
        """``req_id`` computes ``hashes[have:]`` (blocks another request computes stay its)."""
        mine = [h for h in hashes[have:] if h not in self._computer]
        for h in mine:
            self._computer[h] = req_id
        self._claims[req_id] = (mine, asyncio.Event())

    def finish(self, req_id: str) -> None:
        """Its prefill is done (or failed): its blocks are cached, or no longer coming. Idempotent."""
        claim = self._claims.pop(req_id, None)
        if claim is None:
            return
        mine, done = claim
        for h in mine:
            if self._computer.get(h) == req_id:
                del self._computer[h]
        done.set()

    def __len__(self) -> int:
        return len(self._claims)
