"""What an engine measured about itself at start-up: the seed of the conductor's cost models.

A plain msgspec struct with no torch in sight, so that the conductor (and the wire protocol)
can carry and read it; ``mooncake.engine.profile`` produces it.
"""

from __future__ import annotations

import msgspec


class EngineProfile(msgspec.Struct, frozen=True):
    """Measured samples; feed them to
    ``PrefillCostModel.from_profile(p.prefill, chunk_tokens=p.chunk_tokens)`` and
    ``DecodeCostModel.from_profile(p.decode)``."""

    prefill: list[tuple[int, int, float]]  # (new tokens, cached tokens before them, seconds)
    decode: list[tuple[int, int, float]]  # (batch size, KV tokens the batch held, seconds per decode step)
    chunk_tokens: int = 512  # the engine's prefill chunk (the cost model needs it)
    threads: int = 0  # torch CPU threads during the measurement
    seconds: float = 0.0  # wall time the whole profile took
