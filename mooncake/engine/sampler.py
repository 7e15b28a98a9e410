"""Token sampling for a batch, vectorized across rows: logits processors (penalties, logit
bias, min_tokens, grammar mask), then greedy or temperature / top-k / top-p / min-p sampling,
and the chosen tokens' logprobs.

Randomness is counter-based: the uniform number a row samples with is a hash of its
sequence's seed and the index of the token being sampled, so a seeded request draws the
same tokens whatever batch it runs in, on prefill or decode, and after a migration.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from mooncake.protocol import Logprob, Sampling

_M32 = 0xFFFFFFFF


def sequence_seed(sampling: Sampling) -> int:
    """The seed a sequence samples with: the request's (mod 2**63), else a random one."""
    return sampling.seed % (2**63) if sampling.seed is not None else secrets.randbits(63)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values < 2**32."""
    x = ((x >> 16) ^ x) * 0x21F0AAAD & _M32
    x = ((x >> 15) ^ x) * 0x735A2D97 & _M32
    return (x >> 15) ^ x


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row, a function of (seed, position) only."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    x = _mix32(lo ^ _mix32(hi ^ _mix32(positions & _M32)))
    return (x.double() + 0.5) / 2**32


@dataclass
class Row:
    """What the sampler needs of one sequence."""

    sampling: Sampling
    seed: int
    tokens: list[int]  # prompt + generated so far
    num_generated: int  # the last ``num_generated`` of ``tokens`` are output tokens
    banned: Seq[int] = ()  # ids masked for this step (eos and stop ids before min_tokens)


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[Logprob | None]


def _penalties(logits: torch.Tensor, rows: list[Row]) -> None:
    B, V = logits.shape
    dev = logits.device
    outs = [r.tokens[len(r.tokens) - r.num_generated:] for r in rows]
    width = max(1, max(len(o) for o in outs))
    ids = torch.tensor([o + [V] * (width - len(o)) for o in outs], dtype=torch.long, device=dev)
    counts = torch.zeros(B, V + 1, device=dev).scatter_add_(1, ids, torch.ones(B, width, device=dev))[:, :V]
    presence = torch.tensor([r.sampling.presence_penalty for r in rows], device=dev)[:, None]
    frequency = torch.tensor([r.sampling.frequency_penalty for r in rows], device=dev)[:, None]
    rep = torch.tensor([r.sampling.repetition_penalty for r in rows], device=dev)[:, None]
    if (rep != 1).any():
        prompts = [r.tokens[:len(r.tokens) - r.num_generated] for r in rows]
        pw = max(1, max(len(p) for p in prompts))
        pid = torch.tensor([p + [V] * (pw - len(p)) for p in prompts], dtype=torch.long, device=dev)
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=dev).scatter_(1, pid, True)[:, :V] | (counts > 0)
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits))
    logits -= presence * (counts > 0) + frequency * counts


def _index_put(logits: torch.Tensor, entries: list[tuple[int, int, float]], accumulate: bool) -> None:
    if not entries:
        return
    r, c, v = zip(*entries)
    dev = logits.device
    logits.index_put_((torch.tensor(r, device=dev), torch.tensor(c, device=dev)),
                      torch.tensor(v, dtype=logits.dtype, device=dev), accumulate=accumulate)


def process(logits: torch.Tensor, rows: list[Row], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits ``[B, V]`` after penalties, logit bias, banned ids and the grammar ``mask``
    (bool ``[B, V]``, True = allowed; None: no grammar in the batch)."""
    logits = logits.float().clone()
    V = logits.shape[1]
    if any(r.sampling.presence_penalty or r.sampling.frequency_penalty or r.sampling.repetition_penalty != 1
           for r in rows):
        _penalties(logits, rows)
    _index_put(logits, [(i, t, b) for i, r in enumerate(rows) for t, b in r.sampling.logit_bias.items() if t < V],
               accumulate=True)
    _index_put(logits, [(i, t, float("-inf")) for i, r in enumerate(rows) for t in r.banned if t < V],
               accumulate=False)
    if mask is not None:
        logits.masked_fill_(~mask, float("-inf"))
    return logits


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first index whose cumulative mass reaches ``u``."""
    cdf = probs.double().cumsum(-1)
    at = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1))
    return at.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


CANDIDATES = 1024


def _candidates(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the filters can keep, most likely first: the top ``CANDIDATES`` when no row can
    keep a token past them (exact, and far cheaper than sorting the vocabulary), else all."""
    V = probs.shape[1]
    if V > CANDIDATES:
        sp, order = probs.topk(CANDIDATES, -1)
        covered = (k <= CANDIDATES) | ((k == V) & ((sp.sum(-1) >= top_p) | (sp[:, -1] < min_p * sp[:, 0])))
        if bool(covered.all()):
            return sp, order
    return probs.sort(-1, descending=True)


def choose(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """One token id per row of processed ``logits``: greedy where temperature is 0, else sampled."""
    greedy = logits.argmax(-1)
    if all(r.sampling.temperature == 0 for r in rows):
        return greedy
    B, V = logits.shape
    dev = logits.device
    temp = torch.tensor([r.sampling.temperature or 1.0 for r in rows], device=dev)[:, None]
    probs = (logits.float() / temp).softmax(-1)
    u = uniforms(torch.tensor([r.seed for r in rows], device=dev),
                 torch.tensor([r.num_generated for r in rows], device=dev))
    if all(r.sampling.top_k in (0, V) and r.sampling.top_p >= 1 and r.sampling.min_p <= 0 for r in rows):
        sampled = _pick(probs, u)
    else:
        k = torch.tensor([r.sampling.top_k if 0 < r.sampling.top_k < V else V for r in rows], device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in rows], device=dev)
        min_p = torch.tensor([r.sampling.min_p for r in rows], device=dev)
        sp, order = _candidates(probs, k, top_p, min_p)
        keep = torch.arange(sp.shape[1], device=dev)[None, :] < k[:, None]
        sp = sp * keep
        # top-p over the top-k distribution: its mass is the candidates' (k <= candidates) or 1 (no top-k)
        total = torch.where(k < V, sp.sum(-1), torch.ones_like(top_p))
        mass = sp / total[:, None]
        keep &= (mass.cumsum(-1) - mass) < top_p[:, None]  # the mass before a token must not reach top_p
        keep &= sp >= min_p[:, None] * sp[:, :1]
        sampled = order.gather(1, _pick(sp * keep, u).unsqueeze(-1)).squeeze(-1)
    is_greedy = torch.tensor([r.sampling.temperature == 0 for r in rows], device=dev)
    return torch.where(is_greedy, greedy, sampled)


def logprobs_of(raw: torch.Tensor, tokens: torch.Tensor, rows: list[Row]) -> list[Logprob | None]:
    """The chosen tokens' logprobs under the model's distribution (before any processing)
    and the top ``sampling.logprobs`` alternatives, for the rows that asked."""
    want = [r.sampling.logprobs for r in rows]
    if max(want) < 0:
        return [None] * len(rows)
    lp = raw.float().log_softmax(-1)
    chosen = lp.gather(1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    k = max(want)
    top_v, top_i = lp.topk(k, -1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [None if w < 0 else Logprob(chosen[i], top_i[i][:w], top_v[i][:w]) for i, w in enumerate(want)]


def sample(logits: torch.Tensor, rows: list[Row], mask: torch.Tensor | None = None) -> Sampled:
    """One token per row of ``logits [B, V]`` (one host sync for the tokens)."""
    plain = mask is None and all(
        not (r.banned or r.sampling.logit_bias or r.sampling.presence_penalty or r.sampling.frequency_penalty)
        and r.sampling.repetition_penalty == 1 for r in rows)
    processed = logits if plain else process(logits, rows, mask)
    tokens = choose(processed, rows)
    return Sampled(tokens.tolist(), logprobs_of(logits, tokens, rows))
