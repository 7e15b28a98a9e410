"""Per-request engine state and the results of prefill / decode steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mooncake.blocks import BlockHash
from mooncake.protocol import Logprob, Sampling


@dataclass(eq=False)
class Sequence:
    """One request in the engine. ``tokens`` grows by one per generated token.

    ``num_computed`` tokens have their KV in the pool (the last token of
    ``tokens`` is fed next); ``block_table`` lists the pool blocks holding
    positions ``[i*T, (i+1)*T)``; ``block_hashes`` are the chained hashes of its
    full blocks; ``hashes`` is its chain as far as it is known (from ``root``, the
    chain's seed: model identity and cache salt), extended as blocks fill.
    """

    req_id: str
    tokens: list[int]
    sampling: Sampling
    root: BlockHash = BlockHash(b"")
    num_cached_tokens: int = 0
    num_computed: int = 0
    num_generated: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    finished: str = ""  # "" | "stop" | "length"
    seed: int = 0  # the sampler's seed (the request's, else random)
    hashes: list[BlockHash] = field(default_factory=list)  # the chain over its full blocks, as known
    prefilled: bool = False
    uid: int = 0  # unique per engine: identifies the sequence in the decode workspace
    freed: bool = False
    matcher: Any = None  # the grammar's matcher when the output is constrained
    ngrams: Any = None  # speculative decoding's index of its n-grams (``speculative.NgramIndex``), once it drafts

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class PrefillStep:
    new_full_blocks: list[int]  # block indices within the sequence that became full in this chunk
    done: bool
    token: int | None = None  # sampled after the last chunk
    finished: str = ""  # "" | "stop" | "length"
    logits: torch.Tensor | None = None  # last-position logits when done
    logprob: Logprob | None = None  # the token's, when asked for
    compute_s: float = 0.0  # this sequence's share of the forward's time (by tokens, when packed)


@dataclass
class StepOutput:
    seq: Sequence
    token: int | None  # None: no block for this step (sequence intact) or already finished
    finished: str = ""
    logprob: Logprob | None = None  # the token's, when asked for
    more: list[int] = field(default_factory=list)  # speculative decoding: the tokens accepted after ``token``
    more_logprobs: list[Logprob | None] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """Every token this step output for the sequence, in order."""
        return [] if self.token is None else [self.token, *self.more]

    @property
    def logprobs(self) -> list[Logprob]:
        """Their logprobs, when asked for."""
        return [lp for lp in (self.logprob, *self.more_logprobs) if lp is not None]
