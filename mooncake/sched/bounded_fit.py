"""A linear cost model with non-negative weights, fitted online towards a prior so that no
sequence of measurements can make it run away (``cost_model.py`` says what it models).

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

Cost. A refit reads the whole window (~0.1 ms for 256 samples, kept as one numpy array), and a
conductor observes a prefill per request and each decode's steps once a second: the model refits after every sample
while it has few, then once per ``REFIT_SHARE`` of its window (every 32 samples when full), so
each sample costs a few microseconds on average, the fit lags by tens of samples of hundreds,
and a decode's learning costs a refit every few heartbeats, not every one. A batch of samples
(``observe_all``: a heartbeat's decode steps) refits once at most.
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
REFIT_SHARE = 1 / 8  # new samples, as a share of those held, that make a refit due


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


def dot(w: Sequence[float], x: Sequence[float]) -> float:
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
        anchor_s = dot(prior, anchor)
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
        self._ref_prior = [dot(self.prior, x) or dot(self.scale, x) for x in self.references]
        self.strength, self.max_factor, self.clip = strength, max_factor, clip
        # the window: a ring of rows (z, u), numpy from the start (converting lists cost a refit ~0.3 ms)
        self._zu = np.zeros((window, len(self.prior) + 1))
        self._held = 0
        self._next = 0
        self.rejected_fits = 0  # fits discarded as implausible
        self._unfitted = 0  # samples taken since the last refit
        self._streak = 0  # of those, in a row (warned about once)

    @property
    def samples(self) -> int:
        return self._held

    def predict(self, x: Sequence[float]) -> float:
        return dot(self.weights, x)

    def observe(self, x: Sequence[float], y: float) -> bool:
        """Add a sample and refit when one is due; False if the sample was ignored (no work, or
        a duration that is not positive and finite)."""
        taken = self._take(x, y)
        self._refit_if_due()
        return taken

    def observe_all(self, samples: Iterable[tuple[Sequence[float], float]]) -> int:
        """Add several samples (a heartbeat's decode steps) with one refit at most; how many were taken."""
        taken = sum(self._take(x, y) for x, y in samples)
        self._refit_if_due()
        return taken

    def _refit_if_due(self) -> None:
        if self._unfitted >= max(1, int(self._held * REFIT_SHARE)):
            self._refit()

    def _take(self, x: Sequence[float], y: float) -> bool:
        sx = [s * float(v) for s, v in zip(self.scale, x)]
        total = sum(sx)
        if not (y > 0 and math.isfinite(y) and total > 0 and math.isfinite(total)
                and all(v >= 0 for v in sx)):
            return False
        sx.append(float(y))
        row = self._next
        self._zu[row] = [v / total for v in sx]
        self._next = (row + 1) % len(self._zu)
        self._held = min(self._held + 1, len(self._zu))
        self._unfitted += 1
        return True

    def _refit(self) -> None:
        self._unfitted = 0
        held = self._zu[: self._held]  # in ring order, which a fit does not care about
        Z, u = held[:, :-1], held[:, -1]
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
        return all(lo <= dot(weights, x) / ref <= hi for x, ref in zip(self.references, self._ref_prior))


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
