"""How well the scheduler's predictions match what happened: predicted vs realized time to
first token (per prefill instance) and time between tokens (per decode instance), as
Prometheus histograms of the ratio and as recent relative errors (median, p90) for /cluster.
Early rejection is only as good as these predictions; this is how an operator sees it."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from mooncake.metrics import Metrics

WINDOW = 1000  # recent predictions kept for the summary


class Predictions:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.errors: dict[str, deque[float]] = {"ttft": deque(maxlen=WINDOW), "tbt": deque(maxlen=WINDOW)}
        self._ratios: dict[tuple[str, str], Any] = {}  # (kind, instance) -> its histogram (looked up once)
        # every admitted attempt's measured over predicted TTFT, cluster-wide (the cost models' drift at a glance)
        self.ttft_ratio = metrics.ttft_prediction_ratio

    def ttft(self, instance: str, predicted_s: float, actual_s: float) -> None:
        self._record("ttft", instance, predicted_s, actual_s)
        if predicted_s > 0 and actual_s > 0:
            self.ttft_ratio.observe(actual_s / predicted_s)

    def tbt(self, instance: str, predicted_s: float, actual_s: float) -> None:
        self._record("tbt", instance, predicted_s, actual_s)

    def _record(self, kind: str, instance: str, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0 or actual_s <= 0:
            return
        ratio = self._ratios.get((kind, instance))
        if ratio is None:
            ratio = self._ratios[kind, instance] = self.metrics.prediction_ratio.labels(kind, instance)
        ratio.observe(actual_s / predicted_s)
        self.errors[kind].append(abs(predicted_s - actual_s) / actual_s)

    def summary(self) -> dict[str, dict[str, float]]:
        """Relative error |predicted - actual| / actual of recent predictions: count, median, p90."""
        out = {}
        for kind, errs in self.errors.items():
            xs = sorted(errs)
            out[kind] = {"count": len(xs), "median": statistics.median(xs) if xs else 0.0,
                         "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else 0.0}
        return out
