"""One sequence run to its end on an engine alone (prefill, then decode steps), for tests and
checks that compare the engine's output with a reference."""

from __future__ import annotations

from mooncake.engine import Engine
from mooncake.protocol import Sampling


def run_alone(engine: Engine, ids: list[int], sampling: Sampling) -> list[int]:
    """The tokens ``engine`` generates after ``ids`` under ``sampling`` (the sequence freed after)."""
    seq = engine.add_sequence("r", ids, sampling)
    assert seq is not None
    while not seq.prefilled:
        engine.prefill(seq)
    while not seq.finished:
        engine.decode_step([seq])
    engine.free(seq)
    return seq.tokens[len(ids):]
