"""What the scheduler predicts of a colocated instance (``roles/colocated.py``), which runs a
prompt's chunks in the same steps as its decoding batch.

A step carries every decoding sequence's next token and up to ``step_tokens`` (its ``NodeInfo``)
tokens in all, so a prompt advances ``step_tokens - batch`` tokens a step (at least a block) and takes a decode step's
time more per step than it would alone; and each decode step grows by the chunk it carries while
prompts are queued there. Both halves are estimated from the cluster's cost models, the running
batch from the bookings (``booking.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from mooncake.sched.cluster import Node

if TYPE_CHECKING:
    from mooncake.sched.scheduler import Scheduler

# Without a TBT SLO. Measured on the served shared-prefix replay (BENCHMARKS.md section 24): a budget
# sized for 200 ms steps by the profile (80 tokens here) met the SLO for 41 of 120 requests, 256 for 99:
# a step also reads the weights for its decode rows, so small chunks cost prompt throughput.
DEFAULT_STEP_TOKENS = 256
TYPICAL_BATCH, TYPICAL_CTX = 8, 1024  # the decode batch a budget derived from a TBT SLO leaves room for


def fit_step_tokens(step_s: Callable[[int], float], slo_s: float, chunk: int, block: int) -> int:
    """The most tokens per step, in whole blocks up to ``chunk``, whose step (``step_s(tokens)``, with
    ``TYPICAL_BATCH`` sequences of ``TYPICAL_CTX`` tokens decoding) keeps within ``slo_s``; a block
    at least."""
    return max((n for n in range(block, chunk + 1, block) if step_s(n) <= slo_s), default=block)


def _budget(node: Node) -> int:
    return max(1, node.info.step_tokens or 512)


def mixed_prefill_s(sched: Scheduler, node: Node, prefill_s: float, compute_tokens: int, block_tokens: int) -> float:
    """A prompt's prefill time on ``node`` (``prefill_s``: alone) while its booked batch decodes
    (a step gives prompts what the batch leaves of the budget, at least a block)."""
    slots = sched.slots.get(node.node_id)
    batch = len(slots.assigned) if slots is not None else 0
    if not batch:
        return prefill_s
    steps = -(-max(compute_tokens, 1) // max(block_tokens, _budget(node) - batch))
    return prefill_s + steps * sched.decode_cost.predict(batch, slots.kv_tokens_total)


def mixed_tbt_s(sched: Scheduler, node: Node, max_tokens: int, rank: int) -> float:
    """What the prompts queued on ``node`` add to each of its decode steps, spread over a request's
    ``max_tokens`` (at most a full chunk per step): the queue stands in for the prompts that will
    arrive while it decodes."""
    queued_s = sched.queue_s(node.node_id)
    if queued_s <= 0:
        return 0.0
    chunk_s = sched.prefill_cost.predict(_budget(node), 0)
    return min(chunk_s, queued_s / max(1, max_tokens))
