"""What a frontend tells Prometheus about its requests (vLLM's series): prompts admitted,
first tokens (time to first token, queueing, prefix hits), tokens and the gaps between them,
ends, and the waiting/running gauges read from its live requests before a scrape."""

from __future__ import annotations

from typing import Collection

from mooncake import protocol as P
from mooncake.frontend.request import Request, RequestStatus
from mooncake.metrics import Metrics

Reason = P.FinishReason


class RequestMetrics:
    def __init__(self, metrics: Metrics, model_name: str) -> None:
        self.metrics = metrics
        self.name = model_name

    def admitted(self, req: Request) -> None:
        self.metrics.prompt_tokens.labels(self.name).inc(len(req.tokens))
        self.metrics.prefix_queries.labels(self.name).inc(len(req.tokens))

    def started(self, req: Request, msg: P.Started, now: float, first: bool) -> None:
        """An attempt's first token (``first``: the request's first token)."""
        m = self.metrics
        if first:
            m.prefix_hits.labels(self.name).inc(msg.cached_tokens)
            m.ttft.labels(self.name).observe(now - req.arrived)
            m.queue_time.labels(self.name).observe(max(0.0, now - req.arrived - msg.prefill_s - msg.fetch_s))
        m.generation_tokens.labels(self.name).inc()

    def tokens(self, emitted: int, seconds: float) -> None:
        """``emitted`` tokens ``seconds`` after the last ones."""
        if emitted:
            self.metrics.itl.labels(self.name).observe(seconds / emitted)
            self.metrics.generation_tokens.labels(self.name).inc(emitted)

    def finished(self, req: Request, reason: P.FinishReason, now: float) -> None:
        self.metrics.e2e.labels(self.name).observe(now - req.arrived)
        self.metrics.requests.labels({Reason.ABORT: "aborted", Reason.ERROR: "error"}.get(reason, "ok")).inc()

    def gauges(self, requests: Collection[Request], forks_waiting: int) -> None:
        """Waiting and running requests (``forks_waiting``: choices waiting for a prefill)."""
        waiting = sum(1 for r in requests if r.status is RequestStatus.WAITING) + forks_waiting
        self.metrics.num_waiting.labels(self.name).set(waiting)
        self.metrics.num_running.labels(self.name).set(len(requests) + forks_waiting - waiting)
