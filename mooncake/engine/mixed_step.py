"""One forward that carries a decode step and prefill chunks together (a colocated instance's
step, in the manner of Sarathi-Serve's stall-free batching).

Each decoding sequence contributes one row (its last token at position ``num_computed``); the
prefill chunks share what is left of the step's token budget, in order. Rows and chunks pack into
one ``packed_prefill_batch``, so the weights are read once for both halves and a decode step never
waits behind a whole prompt: it waits behind at most ``budget`` prompt tokens. Models with sliding
windows (whose packed masks go by column, not position) and decode batches past ``max_batch`` run
the two halves one after the other instead.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mooncake.engine.batching import packed_prefill_batch
from mooncake.engine.sequence import PrefillStep, Sequence, StepOutput
from mooncake.sched.request_class import FLEX_RANK, rank

if TYPE_CHECKING:
    from mooncake.engine.engine import Engine


def mixed_step(engine: Engine, decoding: list[Sequence], prefilling: list[Sequence],
               budget: int) -> tuple[list[StepOutput], list[PrefillStep]]:
    """One token for each of ``decoding`` (as ``Engine.decode_step``) and the next chunk of each of
    ``prefilling`` (as ``Engine.prefill_many``) within ``budget`` tokens in all (each decoding
    sequence takes one; a prefill chunk left without budget makes no progress this step)."""
    for s in prefilling:
        if s.prefilled or s.freed:
            raise RuntimeError("sequence %s is not waiting for prefill" % s.req_id)
    if not prefilling:
        return engine.decode_step(decoding), []
    if not decoding:
        return [], engine.prefill_many(prefilling, chunk_tokens=budget)
    if engine.model.windows != {None} or len(decoding) > engine.max_batch:
        outs = engine.decode_step(decoding)
        return outs, engine.prefill_many(prefilling, chunk_tokens=max(1, budget - len(decoding)))
    T = engine.block_tokens
    out: dict[int, StepOutput] = {}
    rows: list[tuple[Sequence, int, int, bool]] = []
    for s in decoding:  # as ``decode_step``: a sequence without a block for its next position waits
        if s.finished or s.freed or not s.prefilled:
            out[id(s)] = StepOutput(s, None, s.finished)
            continue
        if s.num_computed // T >= len(s.block_table):
            got = engine.blocks.allocate(1, rank(s.sampling) == FLEX_RANK)
            if got is None:
                out[id(s)] = StepOutput(s, None, "")
                continue
            s.block_table.extend(got)
        rows.append((s, s.num_computed, s.num_computed + 1, True))
    left = max(1, budget - len(rows))  # a prompt always moves, however many decode
    chunks: list[tuple[Sequence, int, int, bool]] = []
    for s in prefilling:
        start, n = s.num_computed, len(s.tokens)
        end = min(n, start + left)
        if end > start and left > 0:
            chunks.append((s, start, end, end == n))
            left -= end - start
    t0 = time.perf_counter()
    logits = engine.model.forward(engine.pool, packed_prefill_batch(rows + chunks, T, engine.device))
    finishing = [s for s, _, _, last in chunks if last]
    sampled = [s for s, *_ in rows] + finishing  # the logit rows, in order
    picked = engine.picker.sample(logits, sampled) if sampled else None
    for i, (s, _, _, _) in enumerate(rows):
        assert picked is not None
        tok, lp = picked.tokens[i], picked.logprobs[i]
        s.num_computed += 1
        if s.num_computed % T == 0:
            engine.register_full(s, s.num_computed - 1, s.num_computed)
        out[id(s)] = StepOutput(s, tok, engine.picker.append(s, tok), lp)
    steps: dict[int, PrefillStep] = {}
    for s, start, end, last in chunks:
        s.num_computed = end
        steps[id(s)] = PrefillStep(engine.register_full(s, start, end), False)
    for j, s in enumerate(finishing, start=len(rows)):
        assert picked is not None and logits is not None
        s.prefilled = True
        tok = picked.tokens[j]
        steps[id(s)] = PrefillStep(steps[id(s)].new_full_blocks, True, tok, engine.picker.append(s, tok), logits[j],
                                   picked.logprobs[j])
    per_token = (time.perf_counter() - t0) / (len(rows) + sum(e - b for _, b, e, _ in chunks))
    for s, start, end, _ in chunks:  # each prompt's share of the forward, by its tokens
        steps[id(s)].compute_s = per_token * (end - start)
    return [out[id(s)] for s in decoding], [steps.get(id(s), PrefillStep([], False)) for s in prefilling]
