"""Bounds of a request's prompt and sampling options, checked where a request enters an engine."""

from __future__ import annotations

from mooncake.engine.errors import InvalidRequestError
from mooncake.protocol import Sampling

MAX_LOGPROBS = 20


def check_request(tokens: list[int], s: Sampling, max_model_len: int, vocab_size: int) -> None:
    """Raise InvalidRequestError (user-facing message, ``param``) for a request an engine cannot serve."""
    if not tokens:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if len(tokens) > max_model_len - 1:
        raise InvalidRequestError(
            "the prompt has %d tokens but the context limit is %d tokens (at most %d prompt "
            "tokens, to leave room for one generated token)"
            % (len(tokens), max_model_len, max_model_len - 1), "prompt")
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        raise InvalidRequestError("prompt token ids must be in [0, %d)" % vocab_size, "prompt")
    if s.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1", "max_tokens")
    if not s.temperature >= 0:
        raise InvalidRequestError("temperature must be >= 0", "temperature")
    if not 0 < s.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
    if s.top_k < 0:
        raise InvalidRequestError("top_k must be >= 0 (0: disabled)", "top_k")
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
