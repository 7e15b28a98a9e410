"""Admission: every reason a request is refused, decided once, before any compute.

A refusal is a typed ``Rejection`` (HTTP status, reason, message, the request
field at fault, when to retry); the HTTP layer maps it to OpenAI's error body.
``check_request`` judges the request against the model and the cluster's caps,
``check_plan`` the scheduler's predictions against the SLOs — only predictions with
evidence behind them (a start-up profile or measurements), and never so long that the
cluster stops learning: after refusing everything for ``probe_after_s`` it admits one
request to re-measure. ``Retry-After`` is the time until the predicted backlog drains,
at most ``max_retry_after_s``.

A request refused because its predicted TTFT is over the SLO leaves its prefix uncached, so
the next request on the same prefix is predicted just as cold: refusing on that prediction
keeps it so for good. The first block of each such refusal that no instance or
store holds or is about to compute is remembered (``COLD_MEMORY`` of them, the least recent
forgotten), and a later request that needs the same block computed is admitted in spite of its TTFT prediction (a *warm-up*: it pays the cold
prefill, and those after it find the prefix cached), provided that the wait ahead of it fits
the SLO: only the cold prefill is over it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mooncake.config import ConductorConfig
from mooncake.metrics import Metrics
from mooncake.protocol import ModelFacts, Sampling
from mooncake.sched.scheduler import Plan


@dataclass(frozen=True)
class Rejection:
    status: int  # HTTP status: 400, 413, 429, 503
    reason: str  # metric label and OpenAI error code
    message: str
    param: str | None = None  # the request field at fault
    retry_after_s: float | None = None


Evidence = tuple[bool, bool]
COLD_MEMORY = 4096  # first uncached blocks of refused requests remembered (warm-ups)


class Admission:
    def __init__(self, cfg: ConductorConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.last_admitted = float("-inf")  # when a plan was last admitted
        self._last: bool | None = None  # the last decision (admitted?), to count flips
        self._cold: OrderedDict[bytes, None] = OrderedDict()  # first uncached block of TTFT refusals

    def check_request(self, tokens: list[int], sampling: Sampling, facts: ModelFacts | None,
                      pool_blocks: int, in_flight: int, waiting: int) -> Rejection | None:
        """``pool_blocks``: the largest KV pool among the instances that would serve it."""
        if facts is None:
            return Rejection(503, "no_workers", "no worker has registered yet", retry_after_s=1)
        if not tokens:
            return Rejection(400, "invalid_prompt", "the prompt is empty", "prompt")
        limit = facts.max_model_len
        if len(tokens) >= limit:
            return Rejection(400, "context_length_exceeded",
                             f"the prompt has {len(tokens)} tokens; this model's context is {limit} tokens "
                             f"(at most {limit - 1} prompt tokens)", "prompt")
        if min(tokens) < 0 or max(tokens) >= facts.vocab_size:
            bad = min(tokens) if min(tokens) < 0 else max(tokens)
            return Rejection(400, "invalid_prompt",
                             f"prompt token id {bad} is outside the vocabulary [0, {facts.vocab_size})", "prompt")
        if sampling.max_tokens < 1:
            return Rejection(400, "invalid_value", "max_tokens must be at least 1", "max_tokens")
        need = -(-(len(tokens) + 1) // facts.block_tokens)
        if pool_blocks and need > pool_blocks:
            return Rejection(400, "context_length_exceeded",
                             f"the prompt needs {need} KV blocks; the largest instance holds {pool_blocks}", "prompt")
        if in_flight >= self.cfg.max_requests:
            return Rejection(503, "overloaded", f"{in_flight} requests in flight; try again later", retry_after_s=1)
        if waiting >= self.cfg.max_waiting:
            return Rejection(503, "overloaded", f"{waiting} requests are queued; try again later", retry_after_s=1)
        return None

    def check_plan(self, plan: Plan | None, now: float, evidence: Evidence = (True, True)) -> Rejection | None:
        """Judge the plan's predictions against the SLOs. A prediction with no evidence behind
        it (no profile, no measurement) never refuses; after refusing everything for
        ``probe_after_s`` one request is admitted to re-measure; a request on a prefix that an
        earlier TTFT refusal left cold may be admitted to warm it up (module docstring).
        ``evidence``: (prefill, decode)."""
        if plan is None:
            return Rejection(503, "no_workers", "no prefill or decode instance is available", retry_after_s=1)
        rejection, warm_up = self._slo(plan, *evidence)
        if rejection is not None and self._ttft_over(plan, evidence[0]):
            self._remember_cold(plan)
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
            if warm_up:
                del self._cold[plan.hashes[plan.known_blocks]]
                self.metrics.admission_warmups.inc()
        return rejection

    def _ttft_over(self, plan: Plan, prefill_evidence: bool) -> bool:
        return bool(prefill_evidence and self.cfg.ttft_slo_ms and plan.best_ttft_s * 1000 > self.cfg.ttft_slo_ms)

    def _slo(self, plan: Plan, prefill_evidence: bool, decode_evidence: bool) -> tuple[Rejection | None, bool]:
        """The first SLO the plan's predictions miss (None: none), and whether the request passed
        the TTFT check only as a warm-up of a cold prefix."""
        cfg = self.cfg
        slo_s = cfg.ttft_slo_ms / 1000
        warm_up = self._ttft_over(plan, prefill_evidence) and self._warms_up(plan, slo_s)
        if self._ttft_over(plan, prefill_evidence) and not warm_up:
            return Rejection(429, "ttft_slo", f"predicted time to first token {plan.best_ttft_s * 1000:.0f} ms "
                             f"exceeds the {cfg.ttft_slo_ms:.0f} ms SLO",
                             retry_after_s=self._retry_after(plan.best_ttft_s - slo_s)), False
        if prefill_evidence and cfg.ttft_slo_ms and plan.est_ttft_s > plan.queue_slack_s:
            # A prefill instance packs the chunks of the requests queued on it into one forward, so
            # a request joining them delays their first tokens too: the queue with it must drain
            # before the first deadline among them that can still be met.
            return Rejection(429, "ttft_slo", f"the requests queued ahead would miss the {cfg.ttft_slo_ms:.0f} ms "
                             "SLO if this one joined them", retry_after_s=self._retry_after(plan.queue_s)), False
        if decode_evidence and cfg.tbt_slo_ms and plan.est_tbt_s * 1000 > cfg.tbt_slo_ms:
            return Rejection(429, "tbt_slo", f"predicted time between tokens {plan.est_tbt_s * 1000:.0f} ms at batch "
                             f"{plan.decode_batch} exceeds the {cfg.tbt_slo_ms:.0f} ms SLO",
                             retry_after_s=self._retry_after(plan.decode_drain_s)), False
        return None, warm_up

    def _warms_up(self, plan: Plan, slo_s: float) -> bool:
        """A request over the TTFT SLO that would compute a prefix an earlier refused request left
        cold, whose wait ahead fits the SLO (only the cold prefill is over it)."""
        return (plan.known_blocks < len(plan.hashes) and plan.hashes[plan.known_blocks] in self._cold
                and plan.est_ttft_s - plan.est_prefill_s <= slo_s)

    def _remember_cold(self, plan: Plan) -> None:
        """Remember the first block of a refused request that nothing holds or is computing (the
        least recent forgotten): a prefix being computed elsewhere is not cold."""
        if plan.known_blocks < len(plan.hashes):
            self._cold[plan.hashes[plan.known_blocks]] = None
            self._cold.move_to_end(plan.hashes[plan.known_blocks])
            if len(self._cold) > COLD_MEMORY:
                self._cold.popitem(last=False)

    def _retry_after(self, seconds: float) -> float:
        """When the predicted backlog will have drained, within [1 s, max_retry_after_s]."""
        return min(self.cfg.max_retry_after_s, max(1.0, seconds))
