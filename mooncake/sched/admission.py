"""Admission: every reason a request is refused, decided once, before any compute.

A refusal is a typed ``Rejection`` (HTTP status, reason, message, the request
field at fault, when to retry); the HTTP layer maps it to OpenAI's error body.
``check_request`` judges the request against the model's context and the cluster's caps
(its token ids against the vocabulary are the frontend's to check),
``check_plan`` the scheduler's predictions against the SLOs and the queue bound (past capacity a
request that would wait more than ``max_queue_wait_s`` before its prompt computes is refused now,
so that goodput plateaus instead of collapsing) — only predictions with
evidence behind them (a start-up profile or measurements), and never so long that the
cluster stops learning: after refusing everything for ``probe_after_s`` it admits one
request to re-measure. ``Retry-After`` is the time until the predicted backlog drains,
at most ``max_retry_after_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.config import AdmissionConfig
from mooncake.config_classes import ClassesConfig
from mooncake.metrics import Metrics
from mooncake.protocol import ModelFacts, Sampling
from mooncake.sched.plan import Plan
from mooncake.sched.request_class import CLASSES, rank


@dataclass(frozen=True)
class Rejection:
    status: int  # HTTP status: 400, 413, 429, 503
    reason: str  # metric label and OpenAI error code
    message: str
    param: str | None = None  # the request field at fault
    retry_after_s: float | None = None


Evidence = tuple[bool, bool]
# what a plan is judged against, per class (``ClassLimits``, else ``[conductor]``; 0: not judged)
JUDGED_LIMITS = ("ttft_slo_ms", "tbt_slo_ms", "max_queue_wait_s")


def context_rejection(n_tokens: int, max_model_len: int) -> Rejection | None:
    """A prompt of ``n_tokens`` that leaves the model's context no token to generate (0: unknown)."""
    if max_model_len and n_tokens >= max_model_len:
        return Rejection(400, "context_length_exceeded",
                         f"the prompt has {n_tokens} tokens; this model's context is {max_model_len} tokens "
                         f"(at most {max_model_len - 1} prompt tokens)", "prompt")
    return None


class Admission:
    def __init__(self, cfg: AdmissionConfig, metrics: Metrics, classes: ClassesConfig | None = None) -> None:
        """``classes``: each class's own limits (``request_class.py``)."""
        self.cfg = cfg
        self.metrics = metrics
        self.classes = classes or ClassesConfig()
        self.last_admitted = float("-inf")  # when a plan was last admitted
        self._last: bool | None = None  # the last decision (admitted?), to count flips

    def check_request(self, n_tokens: int, sampling: Sampling, facts: ModelFacts | None,
                      pool_blocks: int, in_flight: int, waiting: int, choices: int = 1,
                      class_in_flight: int = 0) -> Rejection | None:
        """A prompt of ``n_tokens``; ``pool_blocks``: the largest KV pool among the instances
        that would serve it; ``choices``: the requests it brings (its ``n``: the forks that follow
        it are admitted with it and count against the caps now); ``in_flight``: requests in flight
        cluster-wide, ``class_in_flight`` of them of its class (against the class's
        ``max_share`` of ``max_requests``); ``waiting``: the requests of its class's queue,
        against the class's ``max_waiting``."""
        cls_name = CLASSES[rank(sampling)]
        max_waiting = self.classes.limit(cls_name, "max_waiting", self.cfg)
        share = max(1, int(self.classes.limit(cls_name, "max_share", self.cfg) * self.cfg.max_requests))
        if facts is None:
            return Rejection(503, "no_workers", "no worker has registered yet", retry_after_s=1)
        if not n_tokens:
            return Rejection(400, "invalid_prompt", "the prompt is empty", "prompt")
        rejection = context_rejection(n_tokens, facts.max_model_len)
        if rejection is not None:
            return rejection
        if sampling.max_tokens < 1:
            return Rejection(400, "invalid_value", "max_tokens must be at least 1", "max_tokens")
        need = -(-(n_tokens + 1) // facts.block_tokens)
        if pool_blocks and need > pool_blocks:
            return Rejection(400, "context_length_exceeded",
                             f"the prompt needs {need} KV blocks; the largest instance holds {pool_blocks}", "prompt")
        if choices > min(share, max_waiting):
            return Rejection(400, "invalid_value", f"n={choices} choices are more requests than this cluster takes at "
                             f"once in this class ({min(share, max_waiting)})", "n")
        if in_flight + choices > self.cfg.max_requests:
            return Rejection(503, "overloaded", f"{in_flight} requests in flight; try again later", retry_after_s=1)
        if class_in_flight + choices > share:
            return Rejection(503, "overloaded", f"{class_in_flight} {cls_name} requests in flight, the most this class "
                             f"takes ([classes.{cls_name}] max_share); try again later", retry_after_s=1)
        if waiting + choices > max_waiting:
            return Rejection(503, "overloaded", f"{waiting} requests are queued; try again later", retry_after_s=1)
        return None

    def check_plan(self, plan: Plan | None, now: float, evidence: Evidence = (True, True),
                   limits: tuple[float, float, float] | None = None) -> Rejection | None:
        """Judge the plan's predictions against the SLOs and the queue bound. A prediction with no
        evidence behind it (no profile, no measurement) never refuses; after refusing everything for
        ``probe_after_s`` one request is admitted to re-measure. ``evidence``: (prefill, decode);
        ``limits``: the request's class's ``JUDGED_LIMITS`` (default: ``[conductor]``'s; 0: none)."""
        if plan is None:
            return Rejection(503, "no_workers", "no prefill or decode instance is available", retry_after_s=1)
        ttft_ms, tbt_ms, max_wait_s = limits if limits is not None else \
            (self.cfg.ttft_slo_ms, self.cfg.tbt_slo_ms, self.cfg.max_queue_wait_s)
        rejection = self._slo(plan, *evidence, ttft_ms, tbt_ms)
        if rejection is None and evidence[0] and max_wait_s and not ttft_ms:  # a TTFT SLO judges the wait itself
            rejection = self._queue_wait(plan, max_wait_s)
        if rejection is not None and now - self.last_admitted >= self.cfg.probe_after_s:
            self.metrics.admission_probes.inc()  # a probe: neither the prediction's verdict nor a flip
            self.last_admitted = now
            return None
        admitted = rejection is None
        if self._last is not None and admitted != self._last:
            self.metrics.admission_flips.inc()
        self._last = admitted
        if admitted:
            self.last_admitted = now
        return rejection

    def _slo(self, plan: Plan, prefill_evidence: bool, decode_evidence: bool, ttft_ms: float,
             tbt_ms: float) -> Rejection | None:
        slo_s = ttft_ms / 1000
        if prefill_evidence and ttft_ms and plan.best_ttft_s > slo_s:
            return Rejection(429, "ttft_slo", f"predicted time to first token {plan.best_ttft_s * 1000:.0f} ms "
                             f"exceeds the {ttft_ms:.0f} ms SLO",
                             retry_after_s=self._retry_after(plan.best_ttft_s - slo_s))
        if prefill_evidence and ttft_ms and plan.est_ttft_s > plan.queue_slack_s:
            # A prefill instance packs the chunks of the requests queued on it into one forward, so
            # a request joining them delays their first tokens too: the queue with it must drain
            # before the first deadline among them that can still be met.
            return Rejection(429, "ttft_slo", f"the requests queued ahead would miss the {ttft_ms:.0f} ms "
                             "SLO if this one joined them", retry_after_s=self._retry_after(plan.queue_s))
        if decode_evidence and tbt_ms and plan.est_tbt_s * 1000 > tbt_ms:
            return Rejection(429, "tbt_slo", f"predicted time between tokens {plan.est_tbt_s * 1000:.0f} ms at batch "
                             f"{plan.decode_batch} exceeds the {tbt_ms:.0f} ms SLO",
                             retry_after_s=self._retry_after(plan.decode_drain_s))
        return None

    def _queue_wait(self, plan: Plan, max_wait_s: float) -> Rejection | None:
        """Past capacity: the plan waits longer before its prompt computes than it may. A request
        may wait ``max_wait_s`` less as its own prefill is longer (``max_wait_s**2 / (max_wait_s +
        prefill)``): when some must be refused, those that cost the cluster most go first, so that
        what it admits serves the most requests in time (a cached turn of a conversation waits up to
        the whole bound; a prompt computed from scratch for as long as the bound, half of it)."""
        wait_s = plan.queue_s + plan.reserve_wait_s
        allowed_s = max_wait_s * max_wait_s / (max_wait_s + max(0.0, plan.est_prefill_s))
        if wait_s <= allowed_s:
            return None
        return Rejection(429, "queue_wait", f"the cluster is past its capacity: this request would wait "
                         f"{wait_s:.1f} s before its prompt computes, more than the {allowed_s:.1f} s allowed "
                         f"for its {plan.est_prefill_s:.1f} s of prefill ([admission] max_queue_wait_s "
                         f"{max_wait_s:g} s)", retry_after_s=self._retry_after(wait_s - allowed_s))

    def _retry_after(self, seconds: float) -> float:
        """When the predicted backlog will have drained, within [1 s, max_retry_after_s]."""
        return min(self.cfg.max_retry_after_s, max(1.0, seconds))
