"""N-gram speculative decoding (``[engine] speculative = "ngram"``): drafts from the sequence's own
tokens, verified in the decode step's one forward, accepted exactly as decoding would choose.

**Drafts** (prompt lookup): the longest suffix of the sequence (``speculative_ngram_max`` tokens down to
``speculative_ngram_min``) that occurred earlier in its prompt or output proposes the tokens that followed
its latest occurrence, at most ``num_speculative_tokens``. Answers that quote their prompt (edits, summaries,
RAG answers, code changes) repeat long runs, and the draft costs no model.

**Verify**: the decode step feeds each sequence's last token and its drafts at the next positions, one
row each, on its decode workspace row (``batching.verify_batch``; the decode kernels store every row's
key first, then each row attends up to its own position). A row's logits are bitwise what a one-token
step would compute (``DecoderForward.verify_rows``: the decode kernels and the quantized projections
compute each row alone; where they cannot, speculation stays off), so with the same sampler row --
the tokens before it, its output index, the same counter-based random number -- it picks the very token
decoding would. **Acceptance** walks the rows in order: each picked token is output; the next row counts
only while the picked token equals the draft fed there. Greedy and seeded output are therefore identical
to decoding without speculation. For sampling this is rejection sampling with a draft that is a point
mass on ``d``: accepting ``d`` with probability ``p(d)`` and otherwise drawing from ``p`` without ``d``
renormalized is exactly drawing ``y ~ p`` and accepting when ``y == d`` (the output keeps ``y``), so the
distribution is the model's. The rejected drafts' KV (in the pool past the sequence's length, in the
workspace past its row's length) is never read and is overwritten by later steps: that is the rollback.

Drafting stays within the step's row budget (``verify_rows`` rows for the whole batch, so only small
batches, where a step is bound by reading the weights, speculate), within the pool's free blocks (a draft
never evicts a cached block), and off for constrained output (its grammar state moves token by token)
and for requests that opt out (``"speculative": false``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from mooncake.config import EngineConfig
from mooncake.engine.batching import verify_batch
from mooncake.engine.kv_cache import BlockManager
from mooncake.engine.model.decoder import DecoderForward
from mooncake.engine.sequence import Sequence, StepOutput
from mooncake.engine.token_picker import TokenPicker
from mooncake.sched.request_class import FLEX_RANK, rank

log = logging.getLogger(__name__)


class NgramIndex:
    """The latest earlier occurrence of each n-gram of a sequence's tokens (n in ``sizes``), kept up
    to date as tokens are appended (tokens are only ever appended: rejected drafts never enter)."""

    def __init__(self, sizes: range, tokens: int) -> None:
        self.sizes = sorted(sizes, reverse=True)
        self.tokens = tokens  # drafts to propose next: one more than the last verify accepted (``NgramDrafter``)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.upto = 0  # n-grams ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams ending at positions ``[upto, len(tokens))``: those with a token after them."""
        end = len(tokens)
        for n, latest in self.latest.items():
            for e in range(max(self.upto, n), end):
                latest[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest suffix found."""
        self.update(tokens)
        for n in self.sizes:
            if len(tokens) > n:
                e = self.latest[n].get(tuple(tokens[-n:]))
                if e is not None:
                    return tokens[e:e + limit]
        return []


@dataclass
class SpeculativeCounts:
    """Totals since start (reported with the heartbeats): verify steps, draft tokens fed, drafts
    accepted, tokens output by verify steps (accepted drafts + one picked token per sequence)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"verify_steps": self.verify_steps, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "emitted_tokens": self.emitted_tokens}


class NgramDrafter:
    """Chooses each sequence's drafts for a decode step."""

    def __init__(self, tokens: int, ngram_min: int, ngram_max: int, rows: int, max_batch: int, block_tokens: int,
                 max_model_len: int) -> None:
        """``tokens``: drafts per sequence at most; ``rows``: new tokens one forward may compute (the
        batch's sequences and all their drafts); ``max_batch``: sequences one forward may hold."""
        self.tokens, self.sizes, self.rows, self.max_batch = tokens, range(ngram_min, ngram_max + 1), rows, max_batch
        self.block_tokens, self.max_model_len = block_tokens, max_model_len
        self.counts = SpeculativeCounts()

    def drafts(self, ready: list[Sequence], free_blocks: int) -> tuple[list[list[int]], list[int]]:
        """The drafts of each of ``ready`` (the step's sequences, each holding the block of its next
        position) and the blocks each needs beyond those it holds (``free_blocks`` at most in all);
        every list empty when the batch is too large to speculate."""
        budget = self.rows - len(ready) if len(ready) <= self.max_batch else 0
        out: list[list[int]] = []
        need: list[int] = []
        for i, s in enumerate(ready):
            d = self._draft(s, budget // (len(ready) - i)) if budget > 0 else []  # a fair share of what is left
            T, held = self.block_tokens, len(s.block_table)
            extra = max(0, (s.num_computed + len(d)) // T + 1 - held)
            if extra > free_blocks:  # only into the blocks it holds
                d, extra = d[:held * T - s.num_computed - 1], 0
            free_blocks -= extra
            budget -= len(d)
            out.append(d)
            need.append(extra)
        return out, need

    def _draft(self, s: Sequence, budget: int) -> list[int]:
        sp = s.sampling
        if not sp.speculative or s.matcher is not None:
            return []
        # drafts past the request's last token or the context limit are never output
        limit = min(self.tokens, budget, sp.max_tokens - s.num_generated - 1, self.max_model_len - len(s.tokens) - 1)
        if limit <= 0:
            return []
        if s.ngrams is None:
            s.ngrams = NgramIndex(self.sizes, self.tokens)
        return s.ngrams.propose(s.tokens, min(limit, s.ngrams.tokens))

    def count(self, s: Sequence, drafted: int, output: int) -> None:
        """``s``'s share of a verify step: ``drafted`` fed, ``output`` tokens out. Its next drafts: one
        more than it accepted, so a run of misses costs one row a step and a quoted run grows back."""
        if drafted:
            s.ngrams.tokens = min(self.tokens, output)
        c = self.counts
        c.draft_tokens += drafted
        c.accepted_tokens += output - 1
        c.emitted_tokens += output


def accepted(draft: list[int], picked: list[int]) -> int:
    """How many of the rows' ``picked`` tokens (one per row: after the last token, then after each
    draft) are output: each while the one before it equals the draft fed after it."""
    n = 1
    while n <= len(draft) and picked[n - 1] == draft[n - 1]:
        n += 1
    return n


class Speculation:
    """The decode step with drafts: one forward over every ready sequence's last token and drafts,
    each sequence's accepted tokens out."""

    def __init__(self, drafter: NgramDrafter, model: DecoderForward, pool: torch.Tensor, blocks: BlockManager,
                 picker: TokenPicker, register_full: Callable[[Sequence, int, int], list[int]]) -> None:
        """``register_full(seq, start, end)``: keys the blocks that computing positions [start, end) filled."""
        self.drafter, self.model, self.pool, self.blocks = drafter, model, pool, blocks
        self.picker, self.register_full = picker, register_full

    def step(self, seqs: list[Sequence], ready: list[Sequence], out: dict[int, StepOutput]) -> list[StepOutput] | None:
        """``Engine.decode_step`` of ``seqs`` (``ready``: those stepping, each holding the block of its next
        position; ``out``: the others' outputs) when some draft; None when none does (a plain step)."""
        drafts, need = self.drafter.drafts(ready, len(self.blocks.free))
        if not any(drafts):
            return None
        for s, n in zip(ready, need):  # free blocks only: a draft never evicts a cached block
            if n:
                s.block_table.extend(self.blocks.allocate(n, rank(s.sampling) == FLEX_RANK) or [])
        logits = self.model.forward(self.pool, verify_batch(ready, drafts, self.drafter.block_tokens, self.model.device))
        assert logits is not None
        picked = self.picker.sample(logits, ready, drafts)
        row = 0
        for s, d in zip(ready, drafts):
            tokens, lps = picked.tokens[row:row + len(d) + 1], picked.logprobs[row:row + len(d) + 1]
            row += len(d) + 1
            start, finished, n = s.num_computed, "", 0
            for n, tok in enumerate(tokens[:accepted(d, tokens)], 1):
                if (finished := self.picker.append(s, tok)):
                    break
            s.num_computed += n  # the last token and the drafts the model picked too: their KV is the sequence's
            self.register_full(s, start, s.num_computed)
            self.drafter.count(s, len(d), n)
            out[id(s)] = StepOutput(s, tokens[0], finished, lps[0], tokens[1:n], lps[1:n])
        self.model.rows_kept({s.uid: s.num_computed for s in ready})
        self.drafter.counts.verify_steps += 1
        return [out[id(s)] for s in seqs]


def speculation_for(cfg: EngineConfig, model: DecoderForward, pool: torch.Tensor, blocks: BlockManager,
                    picker: TokenPicker, register_full: Callable[[Sequence, int, int], list[int]],
                    max_model_len: int) -> Speculation | None:
    """Speculative decoding where ``cfg`` asks for it and it is exact here (else None, with a warning)."""
    if cfg.speculative == "off":
        return None
    rows = model.verify_rows
    if rows < 2:
        log.warning("[engine] speculative = %r stays off: this model's decode steps do not run on the engine's own "
                    "kernels (row by row) here, so a verify row could differ from a decode step", cfg.speculative)
        return None
    drafter = NgramDrafter(cfg.num_speculative_tokens, cfg.speculative_ngram_min, cfg.speculative_ngram_max,
                           rows, cfg.max_batch, cfg.block_tokens, max_model_len)
    return Speculation(drafter, model, pool, blocks, picker, register_full)
