"""A colocated step's prompt budget, and what the scheduler predicts of a colocated instance
(``roles/colocated.py``), which runs prompts' chunks in the same steps as its decoding batch.

A step is a token for every decoding sequence and then the next chunks of the prompts being
prefilled. The prompt tokens a step carries are the most (in whole blocks, up to a chunk) whose
predicted step (the decode half at its batch and KV, plus the chunk at its context) stays within
the step's *TBT target*: the tightest ``tbt_slo_ms`` of the classes it decodes, else
``DEFAULT_TBT_TARGET_MS`` (raised where the start-up profile says this machine cannot reach it).
No fixed token count: a slow CPU gets small chunks, a GPU whole ones. The role and the scheduler
compute it with ``prompt_budget``; the role corrects the prediction by what its last steps took
(``StepBudget``), so a step that overran shrinks the next budget at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mooncake.sched.node_registry import Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel

if TYPE_CHECKING:
    from mooncake.protocol.engine_profile import EngineProfile
    from mooncake.sched.booking import DecodeSlots

# A stream's default pace while prompts share its steps: 200 ms a token is 5 tokens (~4 words) a
# second, as fast as people read, so a reader never waits on the stream; on this repository's 2-core
# CPU a step of 8 sequences with a 64-token chunk fits in it (BENCHMARKS.md section 24).
DEFAULT_TBT_TARGET_MS = 200.0
TYPICAL_BATCH, TYPICAL_CTX = 8, 1024  # the batch a default target must leave room for (``reachable_target_ms``)
REACHABLE_MARGIN = 1.5  # a default target is at least this times a typical step with one block of prompt
OVERRUN_DECAY = 0.9  # how fast the correction of an overrun fades, per step that did not overrun
MAX_SCALE = 4.0  # the correction's bounds: [1/MAX_SCALE, MAX_SCALE] (one pathological step moves it that far at most)


def fit_step_tokens(step_s: Callable[[int], float], target_s: float, chunk: int, block: int,
                    least: int | None = None) -> int:
    """The most prompt tokens, in whole blocks up to ``chunk``, whose step (``step_s(tokens)``,
    monotone) keeps within ``target_s``; where not even a block does, ``least`` (default a block:
    a prompt always moves)."""
    lo, hi = 1, max(1, chunk // block)  # in blocks: the answer is in [lo, hi]
    if step_s(hi * block) <= target_s:
        return hi * block
    if step_s(block) > target_s:
        return block if least is None else least
    while lo < hi:  # the largest n with step_s(n * block) <= target_s (lo always qualifies or is 1)
        mid = (lo + hi + 1) // 2
        if step_s(mid * block) <= target_s:
            lo = mid
        else:
            hi = mid - 1
    return lo * block


def prompt_budget(decode_s: float, prefill: PrefillCostModel, ctx: int, target_s: float, chunk: int, block: int,
                  scale: float = 1.0, least: int | None = None) -> int:
    """Prompt tokens for a step whose decode half takes ``decode_s`` and whose first prompt has
    ``ctx`` tokens computed, within ``target_s`` (0: no target, a whole chunk); ``scale``: measured
    over predicted step time of the recent steps; ``least``: see ``fit_step_tokens``."""
    if not target_s:
        return chunk
    return fit_step_tokens(lambda n: scale * (decode_s + prefill.predict(n, ctx)), target_s, chunk, block, least)


def reachable_target_ms(profile: EngineProfile | None, block: int) -> float:
    """The default TBT target on the machine ``profile`` measured: ``DEFAULT_TBT_TARGET_MS``, or
    ``REACHABLE_MARGIN`` times a step of ``TYPICAL_BATCH`` sequences of ``TYPICAL_CTX`` tokens with one
    block of prompt where that is longer (a slow machine gets a target it can keep with room for prompts)."""
    if profile is None or not profile.prefill or not profile.decode:
        return DEFAULT_TBT_TARGET_MS
    prefill = PrefillCostModel.from_profile(profile.prefill, chunk_tokens=profile.chunk_tokens)
    decode = DecodeCostModel.from_profile(profile.decode)
    step_s = decode.predict(TYPICAL_BATCH, TYPICAL_BATCH * TYPICAL_CTX) + prefill.predict(block, TYPICAL_CTX)
    return max(DEFAULT_TBT_TARGET_MS, REACHABLE_MARGIN * step_s * 1000)


class StepBudget:
    """A colocated instance's prompt budget per step, from its own steps' fitted costs: the decode
    half's model (shared with the role's flex decisions) and the prompt half's, both fed with every
    step, and a correction by what the last steps took against their prediction."""

    def __init__(self, decode: DecodeCostModel, prefill: PrefillCostModel, chunk: int, block: int) -> None:
        self.decode, self.prefill = decode, prefill
        self.chunk, self.block = chunk, block
        self.scale = 1.0  # measured / predicted step time: jumps at an overrun, fades back after

    def tokens(self, batch: int, kv_tokens: int, ctx: int, target_s: float, least: int | None = None) -> int:
        """Prompt tokens for a step of ``batch`` decoding sequences holding ``kv_tokens``, the first
        prompt at context ``ctx``, within ``target_s`` (0: none); ``least``: see ``fit_step_tokens``."""
        decode_s = self.decode.predict(batch, kv_tokens) if batch else 0.0
        return prompt_budget(decode_s, self.prefill, ctx, target_s, self.chunk, self.block, self.scale, least)

    def observe(self, batch: int, kv_tokens: int, decode_s: float, tokens: int, ctx: int, prompt_s: float) -> None:
        """A step's two halves as measured (``tokens``: prompt tokens computed, at context ``ctx``),
        before the decode half feeds the decode model (the role's, which it feeds with every step)."""
        predicted = self.decode.predict(batch, kv_tokens) if batch else 0.0
        if tokens:
            predicted += self.prefill.predict(tokens, ctx)
            self.prefill.observe(tokens, ctx, prompt_s)
        if predicted > 0 and batch and tokens:  # only mixed steps: the budget is for them
            ratio = min(MAX_SCALE, max(1 / MAX_SCALE, (decode_s + prompt_s) / predicted))
            # slower than predicted: the next budget shrinks at once; faster: it grows back step by step
            self.scale = ratio if ratio > self.scale else OVERRUN_DECAY * self.scale + (1 - OVERRUN_DECAY) * ratio


def _target_s(node: Node) -> float:
    return node.info.step_target_ms / 1000


def _node_budget(prefill_cost: PrefillCostModel, decode_cost: DecodeCostModel, node: Node, batch: int, kv_tokens: int, ctx: int) -> int:
    """Prompt tokens a step of ``node`` carries while ``batch`` sequences holding ``kv_tokens`` decode:
    its fixed ``[engine] step_tokens`` less a token per row where it has one, else as the role
    picks them (``prompt_budget``)."""
    info = node.info
    chunk = info.profile.chunk_tokens if info.profile is not None else 512
    block = info.model.block_tokens if info.model is not None else 16
    if info.step_tokens:
        return max(block, info.step_tokens - batch)
    decode_s = decode_cost.predict(batch, kv_tokens)
    return prompt_budget(decode_s, prefill_cost, ctx, _target_s(node), chunk, block)


def mixed_prefill_s(prefill_cost: PrefillCostModel, decode_cost: DecodeCostModel, slots: DecodeSlots | None,
                    node: Node, prefill_s: float, compute_tokens: int, block_tokens: int) -> float:
    """A prompt's prefill time on ``node`` (``prefill_s``: alone) while its booked batch (``slots``)
    decodes: each step gives it the budget the batch leaves and costs a decode step more."""
    batch = len(slots.assigned) if slots is not None else 0
    if not batch:
        return prefill_s
    budget = _node_budget(prefill_cost, decode_cost, node, batch, slots.kv_tokens_total, 0)
    steps = -(-max(compute_tokens, 1) // max(block_tokens, budget))
    return prefill_s + steps * decode_cost.predict(batch, slots.kv_tokens_total)


def mixed_tbt_s(prefill_cost: PrefillCostModel, decode_cost: DecodeCostModel, slots: DecodeSlots | None,
                queued_s: float, node: Node, max_tokens: int) -> float:
    """What the prompts queued on ``node`` (``queued_s`` of prefill) add to each of its decode steps,
    spread over a request's ``max_tokens`` (at most the chunk a step carries at the booked batch,
    ``slots``): the queue stands in for the prompts that will arrive while it decodes."""
    if queued_s <= 0:
        return 0.0
    batch, kv = (len(slots.assigned), slots.kv_tokens_total) if slots is not None else (0, 0)
    chunk_s = prefill_cost.predict(_node_budget(prefill_cost, decode_cost, node, batch + 1, kv, 0), 0)
    return min(chunk_s, queued_s / max(1, max_tokens))
