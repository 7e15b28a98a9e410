"""Bounds of the sampling options beyond the basic ones, checked where a request enters an engine."""

from __future__ import annotations

from mooncake.engine.errors import InvalidRequestError
from mooncake.protocol import Sampling

MAX_LOGPROBS = 20


def check_sampling(s: Sampling, vocab_size: int) -> None:
    """Raise InvalidRequestError (message, param) for an option out of its range."""
    if not 0 <= s.min_p <= 1:
        raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            raise InvalidRequestError(f"{name} must be in [-2, 2]", name)
    if not 0 < s.repetition_penalty <= 2:
        raise InvalidRequestError("repetition_penalty must be in (0, 2]", "repetition_penalty")
    if s.min_tokens < 0:
        raise InvalidRequestError("min_tokens must be >= 0", "min_tokens")
    if not -1 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
    for t, b in s.logit_bias.items():
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {t} is not in [0, {vocab_size})", "logit_bias")
        if not -100 <= b <= 100:
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
    if any(not 0 <= t < vocab_size for t in s.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
