"""Online cost models: prefill time from token counts, decode step time from batch size.

Each is a small linear model fitted by ridge regression towards a prior, so
that it gives sensible answers before any measurement and follows the machine
as measurements arrive (a ring buffer of recent samples).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np


class OnlineLinearModel:
    """y ~ w . x, refitted on the last ``window`` samples, pulled towards ``prior``."""

    def __init__(self, prior: Sequence[float], window: int = 256, strength: float = 4.0) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.w = self.prior.copy()
        self.weights = [float(v) for v in self.w]
        self._xs: deque[np.ndarray] = deque(maxlen=window)
        self._ys: deque[float] = deque(maxlen=window)
        self.strength = strength

    @property
    def samples(self) -> int:
        return len(self._ys)

    def observe(self, x: Sequence[float], y: float) -> None:
        self._xs.append(np.asarray(x, dtype=np.float64))
        self._ys.append(float(y))
        X = np.stack(self._xs)
        Y = np.asarray(self._ys)
        # Relative ridge: the prior weighs like ``strength`` samples on each weight.
        scale = np.maximum((X * X).mean(axis=0), 1e-12) * self.strength
        A = X.T @ X + np.diag(scale)
        b = X.T @ Y + scale * self.prior
        w = np.linalg.solve(A, b)
        self.w = np.maximum(w, 0.0)  # costs are never negative
        self.weights = [float(v) for v in self.w]

    def predict(self, x: Sequence[float]) -> float:
        # Plain floats: numpy's per-call overhead dominates for 2-3 weights on this hot path.
        return sum(w * v for w, v in zip(self.weights, x))


class PrefillCostModel:
    """Seconds to prefill ``n`` new tokens after ``ctx`` cached ones:
    ``a + b*n + c*n*(ctx + n/2)`` (the last term is attention's quadratic part)."""

    def __init__(self, tokens_per_s: float = 3000.0, fixed_s: float = 0.02, fetch_block_s: float = 0.0005) -> None:
        self.model = OnlineLinearModel([fixed_s, 1000.0 / tokens_per_s, 1e-3 / tokens_per_s])
        self.fetch_block_s = fetch_block_s

    @staticmethod
    def _features(n: int, ctx: int) -> list[float]:
        # Scaled so that all weights are of similar size (helps the ridge prior).
        return [1.0, n / 1000.0, n * (ctx + n / 2) / 1e6]

    def predict(self, n: int, ctx: int) -> float:
        return self.model.predict(self._features(n, ctx))

    def observe(self, n: int, ctx: int, seconds: float) -> None:
        self.model.observe(self._features(n, ctx), seconds)

    def observe_fetch(self, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.fetch_block_s = 0.8 * self.fetch_block_s + 0.2 * (seconds / blocks)


class DecodeCostModel:
    """Seconds per decode step at a given batch size: ``d0 + d1*batch``."""

    def __init__(self, step_s: float = 0.03, per_seq_s: float = 0.002) -> None:
        self.model = OnlineLinearModel([step_s, per_seq_s])

    def predict(self, batch: int) -> float:
        return self.model.predict([1.0, float(batch)])

    def observe(self, batch: int, seconds: float) -> None:
        self.model.observe([1.0, float(batch)], seconds)
