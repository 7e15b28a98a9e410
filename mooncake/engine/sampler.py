"""Token sampling: greedy, temperature, top-k, top-p, per-sequence seeded generators."""

from __future__ import annotations

import torch

from mooncake.protocol import Sampling


def make_generator(sampling: Sampling, device: torch.device) -> torch.Generator | None:
    """A per-sequence generator for non-greedy sampling: seeded if ``seed`` is given."""
    if sampling.temperature == 0:
        return None
    g = torch.Generator(device=device)
    if sampling.seed is not None:
        g.manual_seed(sampling.seed)
    else:
        g.seed()
    return g


def sample_row(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """One token (0-dim tensor) from float logits ``[V]``."""
    if s.temperature == 0:
        return logits.argmax()
    logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= s.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)[0]


def sample(logits: torch.Tensor, samplings: list[Sampling], gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits [B, V]``; greedy rows in one argmax, one host sync in all."""
    greedy = logits.argmax(-1)
    if all(s.temperature == 0 for s in samplings):
        return greedy.tolist()
    picks = [greedy[i] if s.temperature == 0 else sample_row(logits[i], s, gens[i])
             for i, s in enumerate(samplings)]
    return torch.stack(picks).tolist()
