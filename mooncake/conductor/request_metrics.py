"""What the conductor tells Prometheus about requests: prompts admitted, first tokens (time to
first token, queueing, prefix hits), KV moved, tokens and the gaps between them, ends, the
scheduler's predictions against what happened (``Predictions``), and the gauges read from live
state just before a scrape."""

from __future__ import annotations

from typing import Collection

from mooncake import protocol as P
from mooncake.conductor.attempt import Attempt
from mooncake.conductor.request import Request, RequestStatus
from mooncake.metrics import Metrics
from mooncake.sched.cluster import Cluster, Node
from mooncake.sched.predictions import Predictions

Reason = P.FinishReason


class RequestMetrics:
    def __init__(self, metrics: Metrics, model_name: str, predictions: Predictions) -> None:
        self.metrics = metrics
        self.name = model_name
        self.predictions = predictions

    def admitted(self, req: Request) -> None:
        self.metrics.prompt_tokens.labels(self.name).inc(len(req.tokens))
        self.metrics.prefix_queries.labels(self.name).inc(len(req.tokens))

    def prefilled(self, a: Attempt, msg: P.PrefillDone, node: Node, now: float, first: bool) -> None:
        """An attempt's prefill is done on ``node`` (``first``: the request's first token)."""
        m, req = self.metrics, a.request
        self.predictions.ttft(node.node_id, a.plan.est_ttft_s, now - a.started)
        m.kv_bytes.labels("store_to_prefill").inc(msg.fetched_blocks * node.info.block_bytes)
        if first:
            m.prefix_hits.labels(self.name).inc(msg.cached_tokens)
            m.ttft.labels(self.name).observe(now - req.arrived)
            m.queue_time.labels(self.name).observe(max(0.0, now - req.arrived - msg.prefill_s - msg.fetch_s))
        m.generation_tokens.labels(self.name).inc()

    def handed_to_decode(self, req: Request, msg: P.PrefillDone, block_bytes: int, block_tokens: int) -> None:
        """The prefill's KV went to the decode instance (the prompt and the tokens before the last)."""
        n_tokens = len(req.tokens) + len(req.generated) - 1
        self.metrics.kv_bytes.labels("prefill_to_decode").inc(-(-n_tokens // block_tokens) * block_bytes)
        self.metrics.kv_inflight_at_prefill_end.observe(msg.kv_pending_bytes)

    def tokens(self, emitted: int, seconds: float) -> None:
        """``emitted`` tokens ``seconds`` after the last ones."""
        if emitted:
            self.metrics.itl.labels(self.name).observe(seconds / emitted)
            self.metrics.generation_tokens.labels(self.name).inc(emitted)

    def finished(self, req: Request, reason: P.FinishReason, now: float) -> None:
        a = req.attempt
        decoded = len(req.generated) - a.tokens_before - 1 if a is not None and a.first_token_at else 0
        if reason in (Reason.STOP, Reason.LENGTH) and decoded > 0:
            self.predictions.tbt(a.plan.decode.node_id, a.plan.est_tbt_s, (now - a.first_token_at) / decoded)
        self.metrics.e2e.labels(self.name).observe(now - req.arrived)
        self.metrics.requests.labels({Reason.ABORT: "aborted", Reason.ERROR: "error"}.get(reason, "ok")).inc()

    def gauges(self, requests: Collection[Request], forks_waiting: int, cluster: Cluster) -> None:
        """Waiting and running requests (``forks_waiting``: choices waiting for a prefill), KV use."""
        m, name = self.metrics, self.name
        waiting = sum(1 for r in requests if r.status is RequestStatus.WAITING) + forks_waiting
        m.num_waiting.labels(name).set(waiting)
        m.num_running.labels(name).set(len(requests) + forks_waiting - waiting)
        decodes = cluster.of_role("decode")
        total = sum(n.info.num_blocks for n in decodes)
        m.kv_usage.labels(name).set(sum(n.load.used_blocks for n in decodes) / total if total else 0.0)
