"""Online cost models: prefill time from token counts, decode step time from batch size and KV.

They drive early rejection, so a wrong model turns into refused requests; they are built
so that no sequence of measurements can make them run away.

The model. Both are linear in non-negative weights over features that never decrease
with the work, so predictions are monotone in tokens, context and batch size:

- prefill of ``n`` new tokens after ``ctx`` cached ones:
  ``a + b*n/1e3 + c*pairs/1e6 + e*masked/1e6``: fixed cost, per token, and attention, whose
  work is the ``pairs = n*(ctx + n/2)`` (query, key) pairs. The engine computes the first
  chunk of a prompt with no cached context with the causal kernel and every other chunk
  (after cached context, or past ``chunk_tokens``) with an explicit mask, which costs about
  twice as much per pair on CPU: ``masked`` counts those pairs, ``e`` is their extra cost.
  ``masked`` never decreases with ``n`` or ``ctx`` (going from no context to some context
  moves the first chunk's pairs into it), so neither does the prediction;
- one decode step: ``d0 + d1*batch + d2*kv/1e3``, ``kv`` the KV tokens the batch holds;
- and, outside the fit, what a request spends between dispatch and its prefill beyond the
  queues: messages between the roles and the decode instance's reservation (made between
  its engine steps), as the median of recent requests that met no queue.

The fit. Each weight is ``w_j = s_j * t_j``: ``s_j`` is the prior's weight, floored so that
every term carries at least 5% of the prior's prediction at an anchor size (a term the prior
puts at zero can still be learned), and ``t_j`` is a dimensionless factor. A sample
``(x, y)`` enters as the row ``z_j = s_j*x_j / S`` with target ``u = y / S``, where
``S = sum_j s_j*x_j``: ``z_j`` is the share of term j in the sample, so a sample informs each
term by how much that term contributes to it (a 2-token prompt says nearly nothing about the
attention terms and cannot move them), and residuals are relative (a short and a long prompt
count alike). The factors minimise, over the last ``window`` samples,

    sum_i (z_i . t - u_i)^2 + strength * sum_j (t_j - t*_j)^2,     0 <= t_j <= max_factor

(``t*`` is the prior; ``strength`` is in units of samples, absolute whatever the size of the
features). The problem is strongly convex and 2- to 4-dimensional: coordinate descent solves
it exactly. Robustness:

- before each refit, every sample's target is clipped to ``[1/clip, clip]`` times the
  previous fit's prediction for it, so one sample (a 100x outlier, a near-zero duration)
  moves the model by a bounded amount, while a machine that really is slower still pulls
  the model along over a few samples;
- a duration that is not positive and finite, or a sample with no work, is ignored;
- a fit whose prediction at any reference size leaves ``[1/max_factor, max_factor]`` times
  the prior's is discarded: the model keeps its last sane fit (at first, the prior).

``from_profile`` fits the prior itself to what the machine measured at start-up
(``mooncake.engine.profile``), so the conductor starts from this machine's own numbers.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from operator import mul
from typing import Iterable, Sequence

import numpy as np

log = logging.getLogger(__name__)

FLOOR_SHARE = 0.05  # least share of the anchor's prior prediction a term's scale carries


def solve_box_qp(A: list[list[float]], b: list[float], lo: Sequence[float], hi: Sequence[float],
                 start: Sequence[float], sweeps: int = 1000, tol: float = 1e-12) -> list[float]:
    """argmin ``t.A.t/2 - b.t`` subject to ``lo <= t <= hi`` (A symmetric positive definite),
    by cyclic coordinate descent (exact for box constraints; warm-started at ``start``)."""
    d = len(b)
    t = [min(max(float(v), lo[j]), hi[j]) for j, v in enumerate(start)]
    for _ in range(sweeps):
        moved = 0.0
        for j in range(d):
            r = b[j] - sum(A[j][k] * t[k] for k in range(d) if k != j)
            v = min(max(r / A[j][j], lo[j]), hi[j])
            moved = max(moved, abs(v - t[j]))
            t[j] = v
        if moved <= tol * (1.0 + max(abs(v) for v in t)):
            break
    return t


def _dot(w: Sequence[float], x: Sequence[float]) -> float:
    return sum(map(mul, w, x))  # the same sum, in order, without a Python step per term


class BoundedLinearModel:
    """``y ~ sum_j w_j x_j`` with ``w_j >= 0``, refitted towards ``prior`` as samples arrive
    (see the module docstring). ``anchor`` sets the scale floors; ``references`` are the
    feature vectors whose predictions must stay within ``max_factor`` of the prior's."""

    def __init__(self, prior: Sequence[float], anchor: Sequence[float], references: Iterable[Sequence[float]],
                 window: int = 256, strength: float = 2.0, max_factor: float = 30.0, clip: float = 3.0) -> None:
        if len(anchor) != len(prior) or any(not (p >= 0 and math.isfinite(p)) for p in prior):
            raise ValueError("prior weights must be finite and >= 0, one per feature")
        if any(not v > 0 for v in anchor):
            raise ValueError("every anchor feature must be > 0")
        anchor_s = _dot(prior, anchor)
        if not anchor_s > 0:
            raise ValueError("the prior predicts no cost at the anchor size")
        if not (max_factor > 1 and clip > 1 and strength > 0 and window >= 1):
            raise ValueError("need max_factor > 1, clip > 1, strength > 0, window >= 1")
        self.prior = [float(p) for p in prior]
        self.scale = [max(p, FLOOR_SHARE * anchor_s / v) for p, v in zip(self.prior, anchor)]
        self.theta_prior = [p / s for p, s in zip(self.prior, self.scale)]
        self.theta = list(self.theta_prior)
        self.weights = list(self.prior)  # plain floats: numpy's per-call overhead dominates predict
        self.references = [[float(v) for v in x] for x in references]
        # the prior's prediction at each reference (the floored scale's where the prior says 0)
        self._ref_prior = [_dot(self.prior, x) or _dot(self.scale, x) for x in self.references]
        self.strength, self.max_factor, self.clip = strength, max_factor, clip
        self._z: deque[list[float]] = deque(maxlen=window)
        self._u: deque[float] = deque(maxlen=window)
        self.rejected_fits = 0  # fits discarded as implausible
        self._streak = 0  # of those, in a row (warned about once)

    @property
    def samples(self) -> int:
        return len(self._u)

    def predict(self, x: Sequence[float]) -> float:
        return _dot(self.weights, x)

    def observe(self, x: Sequence[float], y: float) -> bool:
        """Add a sample and refit; False if the sample was ignored (no work, or a duration that
        is not positive and finite)."""
        sx = [s * float(v) for s, v in zip(self.scale, x)]
        total = sum(sx)
        if not (y > 0 and math.isfinite(y) and total > 0 and math.isfinite(total)
                and all(v >= 0 for v in sx)):
            return False
        self._z.append([v / total for v in sx])
        self._u.append(float(y) / total)
        self._refit()
        return True

    def _refit(self) -> None:
        Z = np.array(self._z)
        u = np.array(self._u)
        pred = np.maximum(Z @ np.array(self.theta), 1e-9)
        u = np.clip(u, pred / self.clip, pred * self.clip)
        d = Z.shape[1]
        A = Z.T @ Z + self.strength * np.eye(d)
        b = Z.T @ u + self.strength * np.array(self.theta_prior)
        theta = solve_box_qp(A.tolist(), b.tolist(), [0.0] * d, [self.max_factor] * d, self.theta)
        weights = [s * t for s, t in zip(self.scale, theta)]
        if not self._plausible(weights):
            self.rejected_fits += 1
            self._streak += 1
            (log.warning if self._streak == 1 else log.debug)(
                "cost model: discarded an implausible fit %s (prior %s); keeping %s", weights, self.prior, self.weights)
            return
        self._streak = 0
        self.theta, self.weights = theta, weights

    def _plausible(self, weights: Sequence[float]) -> bool:
        lo, hi = 1.0 / self.max_factor, self.max_factor
        return all(lo <= _dot(weights, x) / ref <= hi for x, ref in zip(self.references, self._ref_prior))


def fit_prior(features: Sequence[Sequence[float]], seconds: Sequence[float],
              scale: Sequence[float]) -> list[float] | None:
    """Non-negative weights minimising the relative error over measured samples (a profile),
    nudged towards ``scale`` only where the samples do not determine them. Samples with a
    duration that is not positive and finite are skipped; None if none is left."""
    rows = [(x, y) for x, y in zip(features, seconds) if y > 0 and math.isfinite(y)]
    if not rows:
        return None
    Z = np.array([[s * v / y for s, v in zip(scale, x)] for x, y in rows])
    d = Z.shape[1]
    A = Z.T @ Z + 1e-6 * np.eye(d)  # well-posed even where the samples determine nothing
    b = Z.sum(axis=0) + 1e-6 * np.ones(d)  # targets: relative error 0; the scale is t = 1
    t = solve_box_qp(A.tolist(), b.tolist(), [0.0] * d, [1e9] * d, [1.0] * d)
    return [s * v for s, v in zip(scale, t)]


class RecentMedian:
    """The median of the last ``window`` samples (0 before any): robust to the odd stall."""

    def __init__(self, window: int = 33) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.value = 0.0

    def observe(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._samples.append(seconds)
            self.value = statistics.median(self._samples)


class PrefillCostModel:
    """Seconds to prefill ``n`` new tokens after ``ctx`` cached ones (module docstring):
    ``fixed_s + n/tokens_per_s + attention_s*pairs/1e6 + masked_s*masked/1e6``."""

    ANCHOR = (1024, 1024)
    REFERENCES = ((32, 0), (1024, 0), (1024, 3072))

    def __init__(self, tokens_per_s: float = 3000.0, fixed_s: float = 0.02, fetch_block_s: float = 0.0005,
                 attention_s: float = 0.0, masked_s: float = 0.0, chunk_tokens: int = 512,
                 max_factor: float = 30.0, **fit: float) -> None:
        if not tokens_per_s > 0:
            raise ValueError("tokens_per_s must be > 0")
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.chunk_tokens = chunk_tokens
        self.model = BoundedLinearModel([fixed_s, 1000.0 / tokens_per_s, attention_s, masked_s],
                                        self._features(*self.ANCHOR),
                                        [self._features(*r) for r in self.REFERENCES], max_factor=max_factor, **fit)
        self.fetch_block_s = fetch_block_s
        self.dispatch = RecentMedian()  # s from dispatch to prefill start beyond queues: messages, reservation
        self.transit = RecentMedian()  # the same without the decode instance's reservation

    @classmethod
    def from_profile(cls, samples: Iterable[tuple[int, int, float]], chunk_tokens: int = 512,
                     fetch_block_s: float = 0.0005, max_factor: float = 10.0, **fit: float) -> PrefillCostModel:
        """A model whose prior is fitted to measured ``(n, ctx, seconds)`` samples (the default
        prior where they determine nothing)."""
        rows = [(int(n), int(c), float(s)) for n, c, s in samples if n > 0 and c >= 0]
        default = cls(chunk_tokens=chunk_tokens)
        fitted = fit_prior([default._features(n, c) for n, c, _ in rows], [s for *_, s in rows], default.model.scale)
        if fitted is None or not fitted[1] > 0:  # no per-token cost measured: not a profile of prefill
            fitted = default.model.prior
        fixed, per_1k, attention, masked = fitted
        return cls(1000.0 / per_1k, fixed, fetch_block_s, attention, masked, chunk_tokens, max_factor, **fit)

    def _features(self, n: int, ctx: int) -> list[float]:
        n, ctx = max(n, 0), max(ctx, 0)
        pairs = n * (ctx + n / 2)
        causal = 0.0 if ctx else min(n, self.chunk_tokens) ** 2 / 2
        return [1.0, n / 1000.0, pairs / 1e6, (pairs - causal) / 1e6]

    @property
    def weights(self) -> list[float]:
        """``[fixed_s, s per 1000 tokens, s per 1e6 attention pairs, extra s per 1e6 masked pairs]``."""
        return list(self.model.weights)

    def predict(self, n: int, ctx: int) -> float:
        return self.model.predict(self._features(n, ctx))

    def observe(self, n: int, ctx: int, seconds: float) -> None:
        if n > 0 and ctx >= 0:
            self.model.observe(self._features(n, ctx), seconds)

    def observe_fetch(self, blocks: int, seconds: float) -> None:
        """Moving average of seconds per fetched block; one sample moves it by a bounded factor."""
        if blocks > 0 and seconds > 0 and math.isfinite(seconds):
            per = min(max(seconds / blocks, self.fetch_block_s / self.model.clip),
                      self.fetch_block_s * self.model.clip)
            self.fetch_block_s = 0.8 * self.fetch_block_s + 0.2 * per


class DecodeCostModel:
    """Seconds per decode step of ``batch`` sequences that hold ``kv_tokens`` of KV in all:
    ``step_s + per_seq_s*batch + per_1k_kv_s*kv_tokens/1e3`` (each step reads every
    sequence's KV: at 1,000 tokens each, attention is a large part of a CPU decode step)."""

    ANCHOR = (8, 8192)
    REFERENCES = ((1, 128), (8, 8192), (64, 65536))

    def __init__(self, step_s: float = 0.03, per_seq_s: float = 0.002, per_1k_kv_s: float = 0.002,
                 max_factor: float = 30.0, **fit: float) -> None:
        self.model = BoundedLinearModel([step_s, per_seq_s, per_1k_kv_s], self._features(*self.ANCHOR),
                                        [self._features(*r) for r in self.REFERENCES], max_factor=max_factor, **fit)

    @classmethod
    def from_profile(cls, samples: Iterable[tuple[int, int, float]], max_factor: float = 10.0,
                     **fit: float) -> DecodeCostModel:
        """A model whose prior is fitted to measured ``(batch, KV tokens, seconds per step)`` samples."""
        rows = [(int(b), int(kv), float(s)) for b, kv, s in samples if b > 0 and kv >= 0]
        default = cls().model
        prior = fit_prior([cls._features(b, kv) for b, kv, _ in rows], [s for *_, s in rows], default.scale)
        if prior is None or not _dot(prior, cls._features(*cls.ANCHOR)) > 0:
            prior = default.prior
        return cls(*prior, max_factor=max_factor, **fit)

    @staticmethod
    def _features(batch: int, kv_tokens: int) -> list[float]:
        return [1.0, float(max(batch, 0)), max(kv_tokens, 0) / 1000.0]

    @property
    def weights(self) -> list[float]:
        """``[seconds per step, seconds per sequence in the batch, seconds per 1,000 KV tokens]``."""
        return list(self.model.weights)

    def predict(self, batch: int, kv_tokens: int) -> float:
        return self.model.predict(self._features(batch, kv_tokens))

    def observe(self, batch: int, kv_tokens: int, seconds: float) -> None:
        if batch > 0 and kv_tokens >= 0:
            self.model.observe(self._features(batch, kv_tokens), seconds)
