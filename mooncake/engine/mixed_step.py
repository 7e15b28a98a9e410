"""A colocated instance's step: a decode step and prompt chunks under one token budget (in the
manner of Sarathi-Serve's stall-free batching: a decoding sequence waits behind at most the
budget's prompt tokens per token, never behind a whole prompt).

The two halves run as two forwards, one after the other, not packed into one: a packed forward
gathers every decoding sequence's whole past into the key columns and scores each row against
all of them (rows x all keys, where a decode row needs only its own), and it leaves the decode
kernels (``engine/kernels``) unused. Measured on the served trace replay at twice its rate
(BENCHMARKS.md section 24), the packed step's ITL p99 was 848 ms against 156 ms for a
prefill/decode pair; reading the weights twice costs a fraction of that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mooncake.engine.sequence import PrefillStep, Sequence, StepOutput

if TYPE_CHECKING:
    from mooncake.engine.engine import Engine


def mixed_step(engine: Engine, decoding: list[Sequence], prefilling: list[Sequence],
               budget: int) -> tuple[list[StepOutput], list[PrefillStep]]:
    """One token for each of ``decoding`` (``Engine.decode_step``), then the next chunks of
    ``prefilling`` (``Engine.prefill_many``) within what is left of ``budget`` tokens (each decoding
    sequence takes one; a prompt always advances by at least one block)."""
    outs = engine.decode_step(decoding) if decoding else []
    if not prefilling:
        return outs, []
    left = max(engine.block_tokens, budget - len(decoding))
    return outs, engine.prefill_many(prefilling, chunk_tokens=left)
