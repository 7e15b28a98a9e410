"""What the conductor tells Prometheus about attempts: KV moved, the scheduler's predictions
against what happened (``Predictions``). The frontends count requests and tokens
(``mooncake.frontend.request_metrics``)."""

from __future__ import annotations

from mooncake import protocol as P
from mooncake.conductor.attempt import Attempt
from mooncake.conductor.attempt_trace import AttemptTraces
from mooncake.config_observability import ObservabilityConfig
from mooncake.metrics import Metrics
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.predictions import Predictions
from mooncake.tracing import role_tracer


class AttemptMetrics:
    def __init__(self, metrics: Metrics, model_name: str, predictions: Predictions,
                 observability: ObservabilityConfig | None = None) -> None:
        self.metrics = metrics
        self.traces = AttemptTraces(role_tracer(observability, "conductor") if observability else None)
        self.name = model_name
        self.predictions = predictions
        self.store_to_prefill, self.prefill_to_decode = (metrics.kv_bytes.labels(way) for way in
                                                         ("store_to_prefill", "prefill_to_decode"))

    def prefilled(self, a: Attempt, msg: P.PrefillDone, node: Node, seconds: float) -> None:
        """An attempt's prefill is done on ``node``, ``seconds`` after it was placed."""
        self.predictions.ttft(node.node_id, a.plan.est_ttft_s, seconds)
        self.traces.prefilled(a.wire_id, a.plan.est_ttft_s, seconds)
        if msg.fetched_blocks:
            self.store_to_prefill.inc(msg.fetched_blocks * node.info.moved_block_bytes)  # encoded, as they travel

    def handed_to_decode(self, a: Attempt, msg: P.PrefillDone, block_bytes: int, block_tokens: int) -> None:
        """The prefill's KV went to the decode instance (the prompt and the tokens before the last)."""
        n_tokens = a.submit.n_tokens - 1
        self.prefill_to_decode.inc(-(-n_tokens // block_tokens) * block_bytes)
        self.metrics.kv_inflight_at_prefill_end.observe(msg.kv_pending_bytes)

    def ended(self, a: Attempt, decoded: int, decode_s: float, now: float) -> None:
        """An attempt its frontend released after ``decoded`` tokens from decode in ``decode_s``."""
        self.traces.ended(a.wire_id)
        if decoded > 0 and decode_s > 0:
            self.predictions.tbt(a.plan.decode.node_id, a.plan.est_tbt_s, decode_s / decoded)

    def kv_usage(self, cluster: Cluster) -> None:
        decodes = cluster.of_role("decode") + cluster.of_role("colocated")
        total = sum(n.info.num_blocks for n in decodes)
        self.metrics.kv_usage.labels(self.name).set(sum(n.load.used_blocks for n in decodes) / total if total else 0.0)
