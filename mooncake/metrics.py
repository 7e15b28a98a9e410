"""Prometheus metrics of the conductor (prefix ``mooncake:``), in their own registry.

The serving metrics carry vLLM's names (``mooncake:num_requests_running``,
``mooncake:time_to_first_token_seconds``, ...) and a ``model_name`` label, and exist
from start-up (at 0), so dashboards and autoscalers made for vLLM work unchanged.
Cumulative values are Counters, those the nodes report as totals too (``report``
adds what grew since the last report). Series of a node that left are removed
(``forget_node``).
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 0.01)


# the by-class series' names of the last release (label service_tier), kept one release: attribute -> old name
DEPRECATED_CLASS_SERIES = {"class_ttft": "mooncake:class_time_to_first_token_seconds",
                           "class_itl": "mooncake:class_inter_token_latency_seconds",
                           "class_queue_time": "mooncake:class_request_queue_time_seconds",
                           "class_requests": "mooncake:class_requests", "class_preemptions": "mooncake:class_preemptions"}


def _renamed(metric: MetricWrapperBase, old_name: str, registry: CollectorRegistry) -> MetricWrapperBase:
    """``metric`` under its deprecated name ``old_name``, its ``request_class`` label called ``service_tier``."""
    labels = ["service_tier" if n == "request_class" else n for n in metric._labelnames]
    doc = f"Deprecated: use {metric._name} (label request_class); removed in the next release. {metric._documentation}"
    extra = {"buckets": metric._upper_bounds} if isinstance(metric, Histogram) else {}
    return type(metric)(old_name, doc, labels, registry=registry, **extra)


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.before_render: list[Callable[[], None]] = []  # refresh the gauges read from live state
        # node -> (metric's id, label values) -> (metric, child): a label lookup costs more than the count
        self._node_series: dict[str, dict[tuple[int, tuple[str, ...]], tuple[MetricWrapperBase, Any]]] = {}
        self._reported: dict[tuple[int, tuple[str, ...]], float] = {}
        m = ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=_LATENCY_BUCKETS, registry=r)

        # vLLM's serving metrics, per model
        self.ttft = hist("mooncake:time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("mooncake:inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = hist("mooncake:e2e_request_latency_seconds", "Request latency, arrival to last token.")
        self.queue_time = hist("mooncake:request_queue_time_seconds", "Arrival to prefill start.")
        self.num_running = Gauge("mooncake:num_requests_running", "Requests on an instance (reserving, prefilling "
                                 "or decoding).", m, registry=r)
        self.num_waiting = Gauge("mooncake:num_requests_waiting", "Requests admitted and waiting for an instance.",
                                 m, registry=r)
        self.kv_usage = Gauge("mooncake:kv_cache_usage_perc", "Fraction of the decode instances' KV blocks held by "
                              "sequences (1 = full).", m, registry=r)
        self.prompt_tokens = Counter("mooncake:prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r)
        self.generation_tokens = Counter("mooncake:generation_tokens", "Generated tokens.", m, registry=r)
        self.prefix_queries = Counter("mooncake:prefix_cache_queries", "Prompt tokens looked up in the KV cache.",
                                      m, registry=r)
        self.prefix_hits = Counter("mooncake:prefix_cache_hits", "Prompt tokens served from cached KV.", m, registry=r)
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.num_running, self.num_waiting,
                       self.kv_usage, self.prompt_tokens, self.generation_tokens, self.prefix_queries,
                       self.prefix_hits):
            metric.labels(model_name)  # exported at 0 from start-up

        # the same, by request class (label ``request_class``: default, priority, flex; the API's ``service_tier``)
        def by_class(name: str, doc: str) -> Histogram:
            return Histogram(name, doc + " By request class.", ["model_name", "request_class"],
                             buckets=_LATENCY_BUCKETS, registry=r)

        self.class_ttft = by_class("mooncake:request_class_time_to_first_token_seconds", "Time to first token.")
        self.class_itl = by_class("mooncake:request_class_inter_token_latency_seconds", "Time between output tokens.")
        self.class_queue_time = by_class("mooncake:request_class_queue_time_seconds", "Arrival to prefill start.")
        self.class_requests = Counter("mooncake:request_class_requests", "Finished requests by request class and "
                                      "outcome.", ["request_class", "outcome"], registry=r)
        self.class_preemptions = Counter("mooncake:request_class_preemptions", "Requests a decode instance gave back "
                                         "for lack of KV blocks, by request class.", ["request_class"], registry=r)
        # the same series under the last release's names, whose label called a request class a tier
        # (``service_tier``): deprecated, emitted beside the ones above for one release, then removed
        self.old_class_series = {attr: _renamed(getattr(self, attr), old, r) for attr, old in DEPRECATED_CLASS_SERIES.items()}
        # by tenant (an API key's id, never the key; "" without keys), as a frontend sees them
        self.tenant_requests = Counter("mooncake:tenant_requests", "Requests by tenant and outcome (refused: with "
                                       "the reason).", ["tenant", "outcome"], registry=r)
        self.tenant_tokens = Counter("mooncake:tenant_tokens", "Prompt and generated tokens by tenant.",
                                     ["tenant", "kind"], registry=r)

        # the cluster's own
        self.decision = Histogram("mooncake:scheduler_decision_seconds", "Scheduler decision time.",
                                  buckets=_FAST_BUCKETS, registry=r)
        self.kv_bytes = Counter("mooncake:kv_bytes_moved", "KV bytes moved between roles, as they travel (encoded by [model] kv_codec).", ["path"], registry=r)
        self.rejected = Counter("mooncake:requests_rejected", "Requests refused.", ["reason"], registry=r)
        self.requests = Counter("mooncake:requests", "Finished requests by outcome.", ["outcome"], registry=r)
        self.prefill_dispatched = Counter("mooncake:prefill_dispatched", "Prefill requests sent to an instance.",
                                          ["instance"], registry=r)
        self.running = Gauge("mooncake:instance_requests_running", "Requests running per instance.", ["instance"],
                             registry=r)
        self.waiting = Gauge("mooncake:instance_requests_waiting", "Requests waiting per instance.", ["instance"],
                             registry=r)
        self.tier_used = Gauge("mooncake:tier_used_bytes", "Bytes used per node and tier.", ["node", "tier"], registry=r)
        self.tier_hits = Counter("mooncake:tier_hits", "Hits per node and tier.", ["node", "tier"], registry=r)
        self.tier_evictions = Counter("mooncake:tier_evictions", "Evictions per node and tier.", ["node", "tier"],
                                      registry=r)
        self.tier_flex_evictions = Counter("mooncake:tier_flex_evictions", "Evictions of blocks only flex requests "
                                           "wrote, per node and tier (part of mooncake:tier_evictions).",
                                           ["node", "tier"], registry=r)
        self.device_evictions = Counter("mooncake:device_cache_evictions", "Device prefix-cache blocks evicted "
                                        "per instance, by class (flex: held only by flex requests; session: kept for "
                                        "a session; other).",
                                        ["node", "class"], registry=r)
        self.index_blocks = Gauge("mooncake:kv_index_blocks", "Blocks in the global KV index.", registry=r)
        self.nodes = Gauge("mooncake:nodes", "Live nodes per role.", ["role"], registry=r)
        self.replications = Counter("mooncake:replications", "Hot blocks replicated.", registry=r)
        self.store_write_blocks = Counter("mooncake:store_write_blocks", "Prompt blocks the store write admission "
                                          "had written (decision=written) or left unwritten, seen once (skipped): "
                                          "[conductor] store_writes = reused.", ["decision"], registry=r)
        self.migrations = Counter("mooncake:migrations", "Requests moved after a worker failed, died or stalled.",
                                  registry=r)
        self.prediction_ratio = Histogram(
            "mooncake:prediction_ratio", "Realized over predicted time (kind: ttft per prefill instance, tbt per "
            "decode instance).", ["kind", "instance"], buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4),
            registry=r)
        self.ttft_prediction_ratio = Histogram(
            "mooncake:ttft_prediction_ratio", "Measured over predicted time to first token of each admitted attempt "
            "(from its placement to its prefill's report), cluster-wide.",
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4), registry=r)
        self.admission_probes = Counter("mooncake:admission_probes", "Requests admitted against an SLO prediction "
                                        "to re-measure, after rejecting all for a while.", registry=r)
        self.admission_flips = Counter("mooncake:admission_flips", "Admission decisions that differ from the one "
                                       "before (accept <-> reject).", registry=r)
        self.cost_model_rejected_fits = Gauge("mooncake:cost_model_rejected_fits", "Implausible cost-model fits "
                                              "discarded (the last sane fit kept).", ["model"], registry=r)
        self.preemptions = Counter("mooncake:preemptions", "Requests a decode instance gave back for lack of KV blocks.",
                                   registry=r)
        self.refused_registrations = Counter("mooncake:registrations_refused",
                                             "Registrations refused for their key.", ["reason"], registry=r)
        self.kv_rejected = Counter("mooncake:kv_blocks_rejected", "KV a node refused: forged or corrupt (wrong "
                                   "request token, checksum, shape, dtype or hash), per node and reason.",
                                   ["node", "reason"], registry=r)
        self.kv_inflight_at_prefill_end = Histogram(
            "mooncake:kv_inflight_at_prefill_end_bytes", "KV bytes for decode still queued on the prefill when it "
            "reported the first token (layer-wise transfer keeps this near one layer of the last chunk).",
            buckets=(0, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28), registry=r)
        self.pipeline_requests = Counter("mooncake:pipeline_requests", "Requests whose prefill ran on a pipeline "
                                         "group (chunked pipeline parallelism).", registry=r)
        self.stage_compute = Counter("mooncake:pipeline_stage_compute_seconds", "Seconds pipeline stages computed, "
                                     "by stage index.", ["stage"], registry=r)
        self.stage_idle = Counter("mooncake:pipeline_stage_idle_seconds", "Seconds pipeline stages waited for the "
                                  "previous stage's activations, by stage index.", ["stage"], registry=r)
        self.activation_bytes = Counter("mooncake:pipeline_activation_bytes", "Hidden-state bytes pipeline stages "
                                        "handed to the next stage.", registry=r)
        self.stage_kv_inflight = Histogram(
            "mooncake:pipeline_stage_kv_inflight_bytes", "KV bytes for decode a pipeline stage still had queued "
            "when its part of the prefill was computed.",
            buckets=(0, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28), registry=r)
        self.reconciliation_aborts = Counter("mooncake:reconciliation_aborts", "Requests a registering worker "
                                             "held that the conductor no longer knew there (dropped).", registry=r)
        self.plans = Counter("mooncake:plans", "Attempts the conductor placed (its plans; their rate is plans "
                             "per second).", registry=r)
        self.adopted_attempts = Counter("mooncake:adopted_attempts", "Attempts running when this conductor "
                                        "started that it adopted (their frontends claimed them).", registry=r)
        self.leader_changes = Counter("mooncake:leader_changes", "Times this conductor took the lead (once "
                                      "without [coordination]).", registry=r)
        self.frontend_aborts = Counter("mooncake:frontend_aborts", "Attempts dropped because the frontend that "
                                       "owned them died (nobody would read their streams).", registry=r)
        self.conductor_messages = Counter("mooncake:conductor_messages", "Messages the conductor received, by type.",
                                          ["type"], registry=r)
        self.fallback_routed = Counter("mooncake:fallback_routed", "Attempts a frontend placed itself, over the "
                                       "last known workers, while no conductor led.", registry=r)
        self.tokens_refused = Counter("mooncake:frontend_tokens_refused", "Token messages a frontend dropped (an "
                                      "attempt it no longer runs, or from another decode than its own).", registry=r)
        self.writes_dropped = Counter("mooncake:kv_writes_dropped", "Write-backs to a store a worker dropped (too "
                                      "many in flight).", ["node"], registry=r)
        self.stale_term_refused = Counter("mooncake:stale_term_refused", "Conductor messages a node refused for "
                                          "a leadership term older than the newest it saw (a stale leader's), per "
                                          "node and message type.", ["node", "message"], registry=r)
        self.speculative = {name: Counter(f"mooncake:spec_decode_{name}", text, ["node"], registry=r) for name, text in (
            ("verify_steps", "Decode steps that verified speculative drafts ([engine] speculative), per node."),
            ("draft_tokens", "Draft tokens fed to verify steps, per node."),
            ("accepted_tokens", "Draft tokens accepted (the model picked them too), per node: over draft_tokens, "
                                "the acceptance rate."),
            ("emitted_tokens", "Tokens verify steps output (accepted drafts and one more per sequence), per node: "
                               "over verify_steps, the tokens per step."))}
        # by tenant, as the nodes report them (an API key's id, never the key; "" without keys)
        self.tenant_kept_blocks = Gauge("mooncake:tenant_kept_blocks", "Blocks a tenant's sessions keep, per node "
                                        "(an engine's prefix cache, a store's tiers).", ["node", "tenant"], registry=r)
        self.tenant_store_bytes = Counter("mooncake:tenant_store_bytes", "Bytes a tenant's requests wrote to a store, "
                                          "per node (dropped: past its write budget).", ["node", "tenant", "outcome"],
                                          registry=r)

    def of_node(self, metric: MetricWrapperBase, node_id: str, *labels: str) -> MetricWrapperBase:
        """``metric``'s child for ``node_id`` (its first label), remembered for ``forget_node``."""
        series = self._node_series.get(node_id)
        if series is None:
            series = self._node_series[node_id] = {}
        key = (id(metric), (node_id, *labels))
        known = series.get(key)
        if known is None:
            known = series[key] = (metric, metric.labels(*key[1]))
        return known[1]

    def report(self, counter: Counter, node_id: str, labels: tuple[str, ...], total: float) -> None:
        """A node's running total of ``counter``: the counter grows by what the total grew
        (by the whole total when it went down: the node restarted)."""
        key = (id(counter), (node_id, *labels))
        last = self._reported.get(key, 0.0)
        self._reported[key] = total
        child = self.of_node(counter, node_id, *labels)
        if total != last:
            child.inc(total - last if total > last else total)

    def forget_node(self, node_id: str) -> None:
        """Remove every series of a node that left."""
        for key, (metric, _) in self._node_series.pop(node_id, {}).items():
            try:
                metric.remove(*key[1])
            except KeyError:
                pass
            self._reported.pop(key, None)

    def render(self) -> bytes:
        for refresh in self.before_render:
            refresh()
        return generate_latest(self.registry)
