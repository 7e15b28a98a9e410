"""What a frontend tells Prometheus about its requests (vLLM's series): prompts admitted,
first tokens (time to first token, queueing, prefix hits), tokens and the gaps between them,
ends, the waiting/running gauges read from its live requests before a scrape, and the
pipeline stages' reports of the attempts it drives; time to first token, queueing, gaps,
preemptions and ends by request class (label ``request_class``; the series of the last release,
label ``service_tier``, beside them for one release) too; requests and tokens by tenant."""

from __future__ import annotations

from typing import Any, Collection

from mooncake import protocol as P
from mooncake.config_observability import ObservabilityConfig
from mooncake.frontend.recent_requests import RecentRequests
from mooncake.frontend.request import Request, RequestStatus
from mooncake.metrics import Metrics
from mooncake.tracing import record_span, role_tracer

Reason = P.FinishReason


class RequestMetrics:
    def __init__(self, metrics: Metrics, model_name: str, observability: ObservabilityConfig | None = None) -> None:
        self.recent = RecentRequests()  # finished requests' timelines (``GET /v1/requests/{id}``)
        self.tracer = role_tracer(observability, "frontend") if observability else None
        # each series' child for the model, looked up once (a label lookup per token cost more than the count)
        m, n = metrics, model_name
        self.prompt_tokens, self.prefix_queries = m.prompt_tokens.labels(n), m.prefix_queries.labels(n)
        self.prefix_hits, self.ttft, self.queue_time = m.prefix_hits.labels(n), m.ttft.labels(n), m.queue_time.labels(n)
        self.generation_tokens, self.itl, self.e2e = m.generation_tokens.labels(n), m.itl.labels(n), m.e2e.labels(n)
        self.num_waiting, self.num_running = m.num_waiting.labels(n), m.num_running.labels(n)
        self.metrics = metrics
        outcome = {reason: {Reason.ABORT: "aborted", Reason.ERROR: "error"}.get(reason, "ok") for reason in Reason}
        self.ended = {reason: m.requests.labels(outcome[reason]) for reason in Reason}
        self.by_class = {c: _ClassSeries(m, n, c, outcome) for c in ("default", "priority", "flex")}
        self._outcome = outcome
        self._by_tenant: dict[str, _TenantSeries] = {}  # tenants are API keys: as many as configured

    def admitted(self, req: Request) -> None:
        self.prompt_tokens.inc(len(req.tokens))
        self.prefix_queries.inc(len(req.tokens))
        self._tenant(req.sampling).prompt_tokens.inc(len(req.tokens))

    def refused(self, sampling: P.Sampling, reason: str) -> None:
        """A new request of ``sampling``'s tenant refused for ``reason`` (a Rejection's)."""
        self.metrics.tenant_requests.labels(sampling.tenant, f"refused_{reason}").inc()

    def started(self, req: Request, msg: P.PrefillDone, now: float, first: bool, reserved_at: float = 0.0) -> None:
        """An attempt's first token (``first``: the request's first token; ``reserved_at``: when its
        decode had reserved)."""
        placed = req.attempt.started if req.attempt else now
        req.timeline.prefilled(placed, reserved_at or placed, now, msg.prefill_s, msg.fetch_s, msg.cached_tokens,
                               msg.fetched_blocks, first)
        if first:
            self.prefix_hits.inc(msg.cached_tokens)
            queued = max(0.0, now - req.arrived - msg.prefill_s - msg.fetch_s)
            self.ttft.observe(now - req.arrived)
            self.queue_time.observe(queued)
            c = self._class(req)
            c.ttft.observe(now - req.arrived)
            c.queue_time.observe(queued)
        self.generation_tokens.inc()

    def tokens(self, req: Request, emitted: int, seconds: float) -> None:
        """``emitted`` tokens of ``req`` ``seconds`` after the last ones."""
        if emitted:
            req.timeline.tokens(emitted, req.last_token_at)
            self.itl.observe(seconds / emitted)
            self._class(req).itl.observe(seconds / emitted)
            self.generation_tokens.inc(emitted)
            self._tenant(req.sampling).generation_tokens.inc(emitted)

    def moved(self, req: Request, preempted: bool) -> None:
        """A new attempt of ``req``: after a preemption, or a migration (its worker failed)."""
        req.timeline.moved(preempted, req.last_progress)
        if preempted:
            self.metrics.preemptions.inc()
            self._class(req).preemptions.inc()
        else:
            self.metrics.migrations.inc()

    def finished(self, req: Request, reason: P.FinishReason, now: float) -> None:
        self.e2e.observe(now - req.arrived)
        req.timeline.finish(now)
        self.recent.put(req.req_id, {"id": req.req_id, "finish_reason": reason.value,
                                     "request_class": req.sampling.request_class, "prompt_tokens": len(req.tokens),
                                     "completion_tokens": len(req.generated), **req.timeline.breakdown()})
        if self.tracer is not None and req.trace and req.first_token_at:  # the SSE stream, from the first token
            record_span(self.tracer, "frontend.stream", req.first_token_at, now, req.trace,
                        {"mooncake.request_id": req.req_id, "mooncake.completion_tokens": len(req.generated),
                         "mooncake.decode_steps": req.timeline.decode_steps, "mooncake.finish_reason": reason.value})
        self.ended[reason].inc()
        self._class(req).ended[reason].inc()
        self._tenant(req.sampling).ended[reason].inc()

    def _class(self, req: Request) -> "_ClassSeries":
        return self.by_class.get(req.sampling.request_class) or self.by_class["default"]

    def _tenant(self, sampling: P.Sampling) -> "_TenantSeries":
        series = self._by_tenant.get(sampling.tenant)
        if series is None:
            series = self._by_tenant[sampling.tenant] = _TenantSeries(self.metrics, sampling.tenant, self._outcome)
        return series

    def gauges(self, requests: Collection[Request], forks_waiting: int) -> None:
        """Waiting and running requests (``forks_waiting``: choices waiting for a prefill)."""
        waiting = sum(1 for r in requests if r.status is RequestStatus.WAITING) + forks_waiting
        self.num_waiting.set(waiting)
        self.num_running.set(len(requests) + forks_waiting - waiting)

    def stage_done(self, msg: P.StageDone) -> None:
        """A pipeline stage's report: its compute and idle seconds, the activations it handed on."""
        m, stage = self.metrics, str(msg.stage)
        m.stage_compute.labels(stage).inc(max(0.0, msg.compute_s))
        m.stage_idle.labels(stage).inc(max(0.0, msg.idle_s))
        m.activation_bytes.inc(max(0, msg.activation_bytes))
        m.stage_kv_inflight.observe(max(0, msg.kv_pending_bytes))


class _ClassSeries:
    """One request class's children of the by-class series (looked up once), each with its child of
    the deprecated series of the same meaning (``Metrics.old_class_series``)."""

    def __init__(self, m: Metrics, model_name: str, request_class: str, outcome: dict[P.FinishReason, str]) -> None:
        def both(attr: str, *labels: str) -> _Both:
            return _Both(getattr(m, attr).labels(*labels), m.old_class_series[attr].labels(*labels))

        self.ttft = both("class_ttft", model_name, request_class)
        self.itl = both("class_itl", model_name, request_class)
        self.queue_time = both("class_queue_time", model_name, request_class)
        self.preemptions = both("class_preemptions", request_class)
        self.ended = {reason: both("class_requests", request_class, outcome[reason]) for reason in Reason}


class _Both:
    """A series' child and its deprecated twin's: what one gets, the other gets."""

    __slots__ = ("new", "old")

    def __init__(self, new: Any, old: Any) -> None:
        self.new, self.old = new, old

    def observe(self, value: float) -> None:
        self.new.observe(value)
        self.old.observe(value)

    def inc(self, amount: float = 1) -> None:
        self.new.inc(amount)
        self.old.inc(amount)


class _TenantSeries:
    """One tenant's children of the by-tenant series (looked up once)."""

    def __init__(self, m: Metrics, tenant: str, outcome: dict[P.FinishReason, str]) -> None:
        self.prompt_tokens = m.tenant_tokens.labels(tenant, "prompt")
        self.generation_tokens = m.tenant_tokens.labels(tenant, "generation")
        self.ended = {reason: m.tenant_requests.labels(tenant, outcome[reason]) for reason in Reason}
