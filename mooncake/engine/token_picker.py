"""Choosing and applying each sequence's next token: sampler rows (min_tokens bans the stop
tokens), the grammar mask of constrained sequences, and the stop / length rules that finish a
sequence."""

from __future__ import annotations

from typing import Any

import torch

from mooncake.engine.constraints import Grammars, consume
from mooncake.engine.loading.loader import LoadedModel
from mooncake.engine.sampler import Row, Sampled, sample
from mooncake.engine.sequence import Sequence
from mooncake.protocol import Sampling


def eos_ids(loaded: LoadedModel) -> set[int]:
    """The model's end-of-sequence token ids (generation config, model config, tokenizer)."""
    ids: set[int] = set()
    gc = getattr(loaded.hf_model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), loaded.hf_model.config.eos_token_id,
                getattr(loaded.tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids


class TokenPicker:
    """Samples the next token of a batch of sequences and appends it, deciding when one finishes."""

    def __init__(self, loaded: LoadedModel, vocab_size: int, max_model_len: int, threads: int) -> None:
        self.eos_token_ids = eos_ids(loaded)
        self.max_model_len = max_model_len
        self.grammars = Grammars(loaded.tokenizer, vocab_size, self.eos_token_ids, threads)

    def matcher(self, tokens: list[int], sampling: Sampling, num_generated: int) -> Any:
        """The grammar matcher of a constrained request, having consumed its generated tokens; else None."""
        if not sampling.grammar:
            return None
        return self.grammars.matcher(sampling.grammar, tokens[len(tokens) - num_generated:])

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> Sampled:
        """One token per row of ``logits`` (row i: ``seqs[i]``). With ``drafts`` (a speculative verify),
        ``seqs[i]`` has a row after its last token, then one after each of its drafts in turn: each
        row as the sequence would be sampled with the drafts before it appended (none constrained)."""
        rows, matchers = [], []
        for i, s in enumerate(seqs):
            sp = s.sampling
            for j in range(1 + (len(drafts[i]) if drafts else 0)):
                n = s.num_generated + j
                banned = (list(self.eos_token_ids) + sp.stop_token_ids) if n < sp.min_tokens else ()
                rows.append(Row(sp, s.seed, s.tokens + drafts[i][:j] if j else s.tokens, n, banned))
                matchers.append(s.matcher if j == 0 else None)
        mask = self.grammars.mask(matchers) if any(m is not None for m in matchers) else None
        return sample(logits, rows, mask)

    def append(self, seq: Sequence, token: int) -> str:
        """Add ``token`` to ``seq``; returns its finish reason ("" while it goes on)."""
        seq.tokens.append(token)
        seq.num_generated += 1
        s = seq.sampling
        done_grammar = seq.matcher is not None and consume(seq.matcher, token)
        if token in s.stop_token_ids or (not s.ignore_eos and token in self.eos_token_ids) or done_grammar:
            seq.finished = "stop"
        elif seq.num_generated >= s.max_tokens or len(seq.tokens) >= self.max_model_len:
            seq.finished = "length"
        return seq.finished
