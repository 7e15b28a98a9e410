"""Coalesces the prefill chunks that concurrent requests ask for into one engine call.

Each request's coroutine awaits ``chunk(seq)``; while the engine computes one batch, the
chunks asked for meanwhile gather and go together next (``Engine.prefill_many``: one
forward, the chunk budget shared by request class, then in arrival order). A burst of short
prompts thus costs a few forwards instead of one per prompt, and a lone request goes alone,
at once. Interactive and flex chunks batch in two lanes: an interactive forward stays as
short as its own work, and its batch goes to the engine while a flex one is queued there (the
engine thread runs the more urgent first: ``engine_thread.py``), never behind it. A flex
forward may have a smaller budget (``[classes] flex_chunk_tokens``): an interactive request
arriving while one computes waits for it to end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from mooncake.kv.layers import LayerFn
from mooncake.engine.sequence import PrefillStep, Sequence
from mooncake.sched.request_class import FLEX_RANK, rank, urgency

log = logging.getLogger(__name__)

RunMany = Callable[[list[Sequence], list[LayerFn | None], "int | None"], Awaitable[list[PrefillStep]]]
_Pending = tuple[Sequence, LayerFn | None, "asyncio.Future[PrefillStep]"]


class PrefillBatcher:
    def __init__(self, run_many: RunMany, flex_chunk_tokens: int | None = None) -> None:
        """``run_many(seqs, hooks, chunk_tokens)``: one engine call; ``flex_chunk_tokens``: the
        budget of a flex batch (None: the engine's)."""
        self._run_many = run_many
        self._budget = {False: None, True: flex_chunk_tokens or None}
        self._pending: dict[bool, list[_Pending]] = {False: [], True: []}  # by lane: flex work's?
        self._drainers: dict[bool, asyncio.Task] = {}
        self.calls = 0  # engine calls made (a batch counts once)

    async def chunk(self, seq: Sequence, on_layer: LayerFn | None = None) -> PrefillStep:
        """The next chunk of ``seq`` (computed with whatever else is asked for meanwhile);
        ``on_layer``: its per-layer KV hook (layer-wise transfer)."""
        fut: asyncio.Future[PrefillStep] = asyncio.get_running_loop().create_future()
        lane = rank(seq.sampling) == FLEX_RANK
        self._pending[lane].append((seq, on_layer, fut))
        drainer = self._drainers.get(lane)
        if drainer is None or drainer.done():
            self._drainers[lane] = asyncio.create_task(self._drain(lane))
        return await fut

    async def _drain(self, lane: bool) -> None:
        """One lane's batches, one after another (the other lane's go to the engine meanwhile)."""
        while self._pending[lane]:
            await asyncio.sleep(0)  # callers woken by the same event join this batch
            # a cancelled caller drops out; the chunk budget goes by request class, then arrival
            batch = sorted((p for p in self._pending[lane] if not p[2].done()), key=lambda p: urgency(p[0].sampling))
            self._pending[lane] = []
            # With per-layer KV hooks the engine computes the sequences one by one anyway: each
            # its own call, so that a more urgent one can go between them
            for call in [[p] for p in batch] if any(p[1] is not None for p in batch) else [batch] if batch else []:
                if all(p[2].done() for p in call):  # cancelled meanwhile
                    continue
                self.calls += 1
                await self._run(call, self._budget[lane])

    async def _run(self, batch: list[_Pending], budget: int | None) -> None:
        try:
            steps = await self._run_many([s for s, _, _ in batch], [h for _, h, _ in batch], budget)
        except Exception as e:
            if len(batch) > 1:  # one bad sequence fails only itself: each again alone
                log.warning("batched prefill failed (%s); computing its %d sequences one by one", e, len(batch))
                for one in batch:
                    await self._run([one], budget)
                return
            if not batch[0][2].done():
                batch[0][2].set_exception(e)
            return
        for (_, _, f), step in zip(batch, steps):
            if not f.done():
                f.set_result(step)
