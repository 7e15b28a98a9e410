"""Constrained decoding: a grammar (llguidance) per sequence, applied as a token mask.

A sequence whose ``Sampling.grammar`` is set gets a matcher that has consumed the tokens
it already generated (earlier attempts, the first token from prefill). Each step the
matchers of the batch fill one bitmask (in llguidance's threads) that becomes the
sampler's allowed-token mask; each sampled token is then consumed. A matcher that has
completed its grammar ends the sequence ("stop").
"""

from __future__ import annotations

from typing import Any

import torch

from mooncake.engine.errors import InvalidRequestError


class Grammars:
    """The engine's grammar machinery: the tokenizer index (built on first use, ~0.3 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: set[int], threads: int = 1) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.threads = max(1, threads)
        self._tokenizer: Any = None
        self._executor: Any = None

    def _tok(self) -> Any:
        if self._tokenizer is None:
            import llguidance
            import llguidance.hf
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_ids or None)
            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        return self._tokenizer

    def matcher(self, grammar: str, generated: list[int]) -> Any:
        """A matcher for ``grammar`` that has consumed ``generated``; InvalidRequestError if the
        grammar is invalid or the tokens do not match it."""
        import llguidance
        m = llguidance.LLMatcher(self._tok(), grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError("invalid grammar: " + m.get_error(), "response_format")
        if generated and not m.consume_tokens(list(generated)):
            raise InvalidRequestError("the tokens generated so far do not match the grammar", "response_format")
        return m

    def mask(self, matchers: list[Any]) -> torch.Tensor:
        """Bool ``[B, vocab]`` (True: allowed); rows whose matcher is None allow everything."""
        import llguidance.torch as lt
        self._tok()
        B = len(matchers)
        bits = lt.allocate_token_bitmask(B, self.vocab_size)
        bits.fill_(-1)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        lt.fill_next_token_bitmask_par(self._executor, rows, bits)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(B, -1)[:, :self.vocab_size]
        dead = ~allowed.any(-1)  # a matcher in error allows nothing: end the sequence instead
        if dead.any() and self.eos_ids:
            allowed[dead.nonzero()[:, 0].unsqueeze(-1), torch.tensor(self.eos_ids)] = True
        return allowed


def consume(matcher: Any, token: int) -> bool:
    """Advance a matcher by the sampled token; True when the grammar is complete (or broken)."""
    matcher.consume_token(token)
    return matcher.is_stopped() or matcher.is_error()
