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

How the weights are fitted, robustly, towards a prior: ``bounded_fit.py``. ``from_profile`` fits the prior itself to what the machine measured at start-up
(``mooncake.engine.profile``), so the conductor starts from this machine's own numbers.

``CostModels`` is the pair a cluster runs on: each starts from the start-up profile of the first
instance of its role to register (the machine's own numbers; the built-in prior until then) and
follows what instances report: prefill times with each first token, decode step times with each
heartbeat. Admission only refuses on a prediction with ``evidence`` behind it: a profile or
measurements.
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

from mooncake.metrics import Metrics
from mooncake.protocol.engine_profile import EngineProfile
from mooncake.sched.bounded_fit import BoundedLinearModel, RecentMedian, dot, fit_prior
from mooncake.sched.plan import Plan

log = logging.getLogger(__name__)


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
        if prior is None or not dot(prior, cls._features(*cls.ANCHOR)) > 0:
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

    def observe_all(self, steps: Iterable[tuple[int, int, float]]) -> None:
        """Several steps (batch, KV tokens, seconds), refitted once at most."""
        self.model.observe_all((self._features(int(b), int(kv)), float(s)) for b, kv, s in steps if b > 0 and kv >= 0)


log = logging.getLogger(__name__)


class CostModels:
    """The cluster's prefill and decode models (module docstring): seeded, fed, and judged on evidence."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.prefill = PrefillCostModel()
        self.decode = DecodeCostModel()
        self.profiled: set[str] = set()  # roles whose start-up profile seeded their model
        self._rejected = {role: metrics.cost_model_rejected_fits.labels(role) for role in ("prefill", "decode")}

    def seed(self, role: str, profile: EngineProfile) -> bool:
        """Start ``role``'s model from its first instance's profile; True if it did."""
        if role == "colocated":  # it measured both halves
            return self.seed("prefill", profile) | self.seed("decode", profile)
        if role in self.profiled:
            return False
        if role == "prefill" and profile.prefill:
            seeded = PrefillCostModel.from_profile(profile.prefill, chunk_tokens=profile.chunk_tokens)
            seeded.dispatch, seeded.transit = self.prefill.dispatch, self.prefill.transit
            self.prefill = seeded
        elif role == "decode" and profile.decode:
            self.decode = DecodeCostModel.from_profile(profile.decode)
        else:
            return False
        self.profiled.add(role)
        log.info("%s cost model seeded from a start-up profile (%.1fs of measurements)", role, profile.seconds)
        return True

    def observe_prefill(self, computed: int, cached: int, prefill_s: float, fetched: int, fetch_s: float) -> None:
        self.prefill.observe(computed, cached, prefill_s)
        self.prefill.observe_fetch(fetched, fetch_s)
        self._rejected["prefill"].set(self.prefill.model.rejected_fits)

    def observe_dispatch(self, plan: Plan, started: float, reserved_at: float, prefilled_at: float,
                         worked_s: float) -> None:
        """What an attempt dispatched at ``started`` spent beyond its prefill's work (``worked_s``:
        fetch + compute), when its plan predicted no queue and no wait for decode memory (else
        queueing would count)."""
        if plan.queue_s > 0 or plan.reserve_wait_s > 0 or not reserved_at:
            return
        self.prefill.dispatch.observe(prefilled_at - started - worked_s)
        self.prefill.transit.observe(prefilled_at - reserved_at - worked_s)

    def observe_decode(self, steps: list[tuple[int, int, float]]) -> None:
        self.decode.observe_all(steps)
        self._rejected["decode"].set(self.decode.model.rejected_fits)

    def evidence(self) -> tuple[bool, bool]:
        """Whether the (prefill, decode) models rest on measurements of this machine."""
        return ("prefill" in self.profiled or self.prefill.model.samples > 0,
                "decode" in self.profiled or self.decode.model.samples > 0)
