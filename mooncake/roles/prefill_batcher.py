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

Tenants (API keys) take turns within the interactive lane: a chunk of a tenant whose turn comes
before the lane's batch in flight (``request_class.yields_to``) goes in an express batch of its
own at once, as interactive work does beside flex work, instead of after that batch; and a
forward whose chunks come from several tenants is as long as twice what the most urgent one
computes in it (``shared_budget``), so a short prompt is not held up by another tenant's backlog
and that backlog still moves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from mooncake.kv.layers import LayerFn
from mooncake.engine.sequence import PrefillStep, Sequence
from mooncake.sched.request_class import FLEX_RANK, rank, urgency, yields_to

log = logging.getLogger(__name__)

Lane = tuple[bool, bool]  # (flex work's?, an express batch of a tenant whose turn came first?)
RunMany = Callable[[list[Sequence], list[LayerFn | None], "int | None"], Awaitable[list[PrefillStep]]]
_Pending = tuple[Sequence, LayerFn | None, "asyncio.Future[PrefillStep]"]


class PrefillBatcher:
    def __init__(self, run_many: RunMany, chunk_tokens: int, flex_chunk_tokens: int | None = None) -> None:
        """``run_many(seqs, hooks, chunk_tokens)``: one engine call; ``chunk_tokens``: a forward's
        budget (the engine's); ``flex_chunk_tokens``: a flex batch's (None: the same)."""
        self._run_many = run_many
        self._budget = {False: chunk_tokens, True: flex_chunk_tokens or chunk_tokens}
        self._pending: dict[Lane, list[_Pending]] = {}
        self._drainers: dict[Lane, asyncio.Task] = {}
        self._leading: dict[Lane, Any] = {}  # the sampling of the most urgent chunk of each lane's batch in flight
        self.calls = 0  # engine calls made (a batch counts once)

    async def chunk(self, seq: Sequence, on_layer: LayerFn | None = None) -> PrefillStep:
        """The next chunk of ``seq`` (computed with whatever else is asked for meanwhile);
        ``on_layer``: its per-layer KV hook (layer-wise transfer)."""
        fut: asyncio.Future[PrefillStep] = asyncio.get_running_loop().create_future()
        flex = rank(seq.sampling) == FLEX_RANK
        leading = self._leading.get((flex, False))
        lane = (flex, leading is not None and yields_to(leading, seq.sampling))  # (flex work's?, express?)
        self._pending.setdefault(lane, []).append((seq, on_layer, fut))
        drainer = self._drainers.get(lane)
        if drainer is None or drainer.done():
            self._drainers[lane] = asyncio.create_task(self._drain(lane))
        return await fut

    async def _drain(self, lane: Lane) -> None:
        """One lane's batches, one after another (the other lanes' go to the engine meanwhile)."""
        while self._pending.get(lane):
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
                self._leading[lane] = call[0][0].sampling
                try:
                    await self._run(call, shared_budget([p[0] for p in call], self._budget[lane[0]]))
                finally:
                    self._leading.pop(lane, None)

    async def _run(self, batch: list[_Pending], budget: int) -> None:
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


def shared_budget(seqs: list[Sequence], budget: int) -> int:
    """The budget of one forward of ``seqs`` (most urgent first): ``budget``, or where they come
    from several tenants, at most twice the tokens the first one's tenant computes in it."""
    lead = seqs[0].sampling.tenant
    if all(s.sampling.tenant == lead for s in seqs):
        return budget
    own = sum(len(s.tokens) - s.num_computed for s in seqs if s.sampling.tenant == lead)
    return max(1, min(budget, 2 * own))
