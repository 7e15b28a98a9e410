"""A prefill instance acting as one stage of a pipeline group (chunked pipeline parallelism).

The request's ``StagePlan`` says which layers this stage computes. Stage 0 cuts the prompt into
chunks of ``1/stages`` of ``prefill_chunk_tokens`` (``sched.pipeline.group_chunk_tokens``: the later
stages wait for the first chunk, the last stage drains the last ones alone) and computes its layers
of each; every later stage waits for a
chunk's hidden states from the stage before (``Activations`` on its activation ingress, which
binds only when ``[conductor] cpp_group_size`` > 1), computes its layers and hands its output on,
so stage ``i`` works on chunk ``c`` while stage ``i-1`` works on chunk ``c+1``. Every stage ships
its own layers' KV to the decode instance layer by layer (the group's reused prefix first), which
assembles a block from all stages' layers before using it. The last stage samples the first token
and reports ``PrefillDone``; each stage reports its compute and idle time (``StageDone``).

A stage holds only its layers of the blocks it computes, so they are never keyed for reuse here
and never written to the store; decode writes them as they become whole there (``store_from_block``).
Activations carry the attempt's token and a checksum, checked before use.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any, Awaitable, Callable, Container

import torch

from mooncake import protocol as P
from mooncake.engine import Engine, Sequence
from mooncake.kv.integrity import first_corrupt
from mooncake.kv.prefill_kv import PrefillKV, ShipTo
from mooncake.kv.sender import KVSender
from mooncake.sched.pipeline import group_chunk_tokens
from mooncake.security import allowed
from mooncake.roles.timing import ACTIVATION_TIMEOUT_S

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """This stage cannot play its part (its prefix, or what the previous stage sent)."""


class ActivationInbox:
    """Activations received for this instance's stage requests (queued or running: ``known``), one
    queue per attempt; those of an attempt this instance does not hold (it ended) are dropped."""

    def __init__(self, known: Callable[[str], bool]) -> None:
        self._known = known
        self._queues: dict[str, asyncio.Queue[tuple[P.Activations, torch.Tensor]]] = {}

    def _queue(self, req_id: str) -> asyncio.Queue[tuple[P.Activations, torch.Tensor]]:
        return self._queues.setdefault(req_id, asyncio.Queue())

    def on_frames(self, frames: list, curve: object) -> None:
        """One received message; anything that is not a worker's well-formed Activations is dropped."""
        if not allowed(curve, frames[0], ("worker",)):  # type: ignore[arg-type]
            log.warning("dropping activations from a non-worker key")
            return
        try:
            msg, tensors = P.decode(frames)
            if not isinstance(msg, P.Activations) or len(tensors) != 1 or tensors[0].dim() != 2 \
                    or not tensors[0].dtype.is_floating_point or tensors[0].shape[0] != msg.end - msg.start:
                raise P.ProtocolError("expected Activations with one [tokens, hidden] float frame")
        except P.ProtocolError as e:
            log.warning("dropping malformed activations: %s", e)
            return
        if not self._known(msg.req_id):
            log.debug("activations of %s, which is not held here: dropped", msg.req_id)
            return
        self._queue(msg.req_id).put_nowait((msg, tensors[0]))

    async def get(self, req_id: str, token: bytes, start: int, stopped: object) -> torch.Tensor:
        """The next chunk's hidden states for ``req_id`` (positions from ``start``), checked."""
        q = self._queue(req_id)
        deadline = time.monotonic() + ACTIVATION_TIMEOUT_S
        while True:
            try:
                msg, hidden = await asyncio.wait_for(q.get(), 0.1)
                break
            except asyncio.TimeoutError:
                if stopped():  # type: ignore[operator]
                    raise StageError("aborted") from None
                if time.monotonic() > deadline:
                    raise StageError(f"no activations from the previous stage for {ACTIVATION_TIMEOUT_S:.0f}s") from None
        if not hmac.compare_digest(msg.token, token):
            raise StageError("activations without the attempt's token")
        if msg.start != start:
            raise StageError(f"activations for positions {msg.start}.. where {start}.. was due")
        if await asyncio.to_thread(first_corrupt, [hidden], msg.checksums) is not None:
            raise StageError("activations fail their checksum")
        return hidden

    def drop(self, req_id: str) -> None:
        self._queues.pop(req_id, None)


async def run_stage(req: P.PrefillRequest, seq: Sequence, kv: PrefillKV, fetched: int, fetch_s: float, *,
                    engine: Engine, run_engine: Callable[..., Awaitable[Any]], ship: ShipTo, inbox: ActivationInbox,
                    aborted: Container[str], report: Callable[[P.Msg], Awaitable[None]], node_id: str,
                    progressed: Callable[[], None]) -> None:
    """This instance's part of a group prefill: its layers of every chunk, its KV to decode (through
    ``kv``, attached to ``seq``), its hidden states to the next stage (``ship``), reports to the
    frontend driving the attempt (``report``)."""
    st = req.stage
    assert st is not None
    T = engine.block_tokens
    if seq.num_cached_tokens != st.prefix_blocks * T:
        raise StageError(f"holds {seq.num_cached_tokens // T} of the group's {st.prefix_blocks} prefix blocks")
    if st.prefix_blocks:  # this stage's layers of the reused prefix
        prefix = await run_engine(engine.kv.export_sequence, seq, 0, st.prefix_blocks)
        kv.save_prefix_layers(0, ((layer, prefix[:, layer]) for layer in range(st.layer_lo, st.layer_hi)))
    nxt = KVSender(lambda m, t: ship(st.next_endpoint, m, t)) if st.next_endpoint else None
    compute_s = idle_s = 0.0
    act_bytes = 0
    n = len(seq.tokens)
    try:
        while True:
            start = seq.num_computed
            hidden = None
            if st.index == 0:  # the group's chunks: the pipeline's fill and drain shrink with them
                end = min(n, start + group_chunk_tokens(engine.chunk_tokens, st.stages, T))
            else:
                t0 = time.perf_counter()
                hidden = await inbox.get(req.req_id, req.kv_token, start, lambda: req.req_id in aborted)
                idle_s += time.perf_counter() - t0
                end = start + len(hidden)
            t0 = time.perf_counter()
            step, out = await run_engine(engine.prefill_stage, seq, (st.layer_lo, st.layer_hi), end, hidden,
                                         kv.save_layer)
            compute_s += time.perf_counter() - t0
            progressed()
            if req.req_id in aborted:
                return
            kv.check()
            if nxt is not None:
                assert out is not None
                nxt.put(P.Activations(req.req_id, start, end, token=req.kv_token), [out])
                act_bytes += out.nbytes
                nxt.check()
            if step.done:
                break
        await report(P.StageDone(req.req_id, node_id, st.index, compute_s, idle_s, act_bytes, kv.in_flight()))
        if nxt is None:  # the last stage: the first token
            finished = P.FinishReason(step.finished) if step.finished else None
            await report(P.PrefillDone(
                req.req_id, node_id, int(step.token), cached_tokens=seq.num_cached_tokens,  # type: ignore[arg-type]
                computed_tokens=n - seq.num_cached_tokens, prefill_s=compute_s + idle_s, fetched_blocks=fetched,
                fetch_s=fetch_s, finished=finished, logprob=step.logprob, kv_pending_bytes=kv.in_flight(),
                stages=st.stages))
            if finished is not None:
                return
        else:
            await nxt.finish()
        await kv.wait_for_save()
    finally:
        if nxt is not None:
            nxt.cancel()
        inbox.drop(req.req_id)
