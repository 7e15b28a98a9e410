"""Coalesces the prefill chunks that concurrent requests ask for into one engine call.

Each request's coroutine awaits ``chunk(seq)``; while the engine computes one batch, the
chunks asked for meanwhile gather and go together next (``Engine.prefill_many``: one
forward, the chunk budget shared by request class, then in arrival order; flex chunks wait
for a forward without interactive ones, which thus stays as short as their own work). A
burst of short prompts thus costs a few forwards instead of one per prompt, and a lone
request goes alone, at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from mooncake.kv.layers import LayerFn
from mooncake.engine.sequence import PrefillStep, Sequence
from mooncake.sched.request_class import FLEX_RANK, rank, urgency

log = logging.getLogger(__name__)

RunMany = Callable[[list[Sequence], list[LayerFn | None]], Awaitable[list[PrefillStep]]]
_Pending = tuple[Sequence, LayerFn | None, "asyncio.Future[PrefillStep]"]


class PrefillBatcher:
    def __init__(self, run_many: RunMany) -> None:
        self._run_many = run_many
        self._pending: list[_Pending] = []
        self._drainer: asyncio.Task | None = None
        self.calls = 0  # engine calls made (a batch counts once)

    async def chunk(self, seq: Sequence, on_layer: LayerFn | None = None) -> PrefillStep:
        """The next chunk of ``seq`` (computed with whatever else is asked for meanwhile);
        ``on_layer``: its per-layer KV hook (layer-wise transfer)."""
        fut: asyncio.Future[PrefillStep] = asyncio.get_running_loop().create_future()
        self._pending.append((seq, on_layer, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # callers woken by the same event join this batch
            # a cancelled caller drops out; the chunk budget goes by request class, then arrival
            batch = sorted((p for p in self._pending if not p[2].done()), key=lambda p: urgency(p[0].sampling))
            self._pending = []
            if not batch:
                continue
            if rank(batch[0][0].sampling) != FLEX_RANK:  # interactive work goes alone: a short forward
                self._pending = [p for p in batch if rank(p[0].sampling) == FLEX_RANK]  # flex: the next one
                batch = batch[:len(batch) - len(self._pending)]
            self.calls += 1
            await self._run(batch)

    async def _run(self, batch: list[_Pending]) -> None:
        try:
            steps = await self._run_many([s for s, _, _ in batch], [h for _, h, _ in batch])
        except Exception as e:
            if len(batch) > 1:  # one bad sequence fails only itself: each again alone
                log.warning("batched prefill failed (%s); computing its %d sequences one by one", e, len(batch))
                for one in batch:
                    await self._run([one])
                return
            if not batch[0][2].done():
                batch[0][2].set_exception(e)
            return
        for (_, _, f), step in zip(batch, steps):
            if not f.done():
                f.set_result(step)
