"""Prometheus metrics of the conductor (prefix ``mooncake:``), in their own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 0.01)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("mooncake:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mooncake:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mooncake:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("mooncake:queue_time_seconds", "Arrival to prefill start.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.decision = Histogram("mooncake:scheduler_decision_seconds", "Scheduler decision time.",
                                  buckets=_FAST_BUCKETS, registry=r)
        self.prefix_queries = Counter("mooncake:prefix_cache_queries_tokens", "Prompt tokens looked up in the KV cache.",
                                      registry=r)
        self.prefix_hits = Counter("mooncake:prefix_cache_hits_tokens", "Prompt tokens served from cached KV.",
                                   registry=r)
        self.kv_bytes = Counter("mooncake:kv_bytes_moved", "KV bytes moved between roles.", ["path"], registry=r)
        self.rejected = Counter("mooncake:requests_rejected", "Requests refused.", ["reason"], registry=r)
        self.requests = Counter("mooncake:requests", "Finished requests by outcome.", ["outcome"], registry=r)
        self.prefill_dispatched = Counter("mooncake:prefill_dispatched", "Prefill requests sent to an instance.",
                                          ["instance"], registry=r)
        self.running = Gauge("mooncake:requests_running", "Requests running per instance.", ["instance"], registry=r)
        self.waiting = Gauge("mooncake:requests_waiting", "Requests waiting per instance.", ["instance"], registry=r)
        self.tier_used = Gauge("mooncake:tier_used_bytes", "Bytes used per node and tier.", ["node", "tier"], registry=r)
        self.tier_hits = Gauge("mooncake:tier_hits", "Hits per node and tier.", ["node", "tier"], registry=r)
        self.tier_evictions = Gauge("mooncake:tier_evictions", "Evictions per node and tier.", ["node", "tier"],
                                    registry=r)
        self.index_blocks = Gauge("mooncake:kv_index_blocks", "Blocks in the global KV index.", registry=r)
        self.nodes = Gauge("mooncake:nodes", "Live nodes per role.", ["role"], registry=r)
        self.replications = Counter("mooncake:replications", "Hot blocks replicated.", registry=r)
        self.migrations = Counter("mooncake:migrations", "Requests moved after a worker failed, died or stalled.",
                                  registry=r)
        self.prediction_ratio = Histogram(
            "mooncake:prediction_ratio", "Realized over predicted time (kind: ttft per prefill instance, tbt per "
            "decode instance).", ["kind", "instance"], buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4),
            registry=r)
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
        self.kv_rejected = Gauge("mooncake:kv_blocks_rejected", "KV a node refused: forged or corrupt (wrong request "
                                 "token, checksum, shape, dtype or hash), per node and reason.", ["node", "reason"],
                                 registry=r)
        self.kv_inflight_at_prefill_end = Histogram(
            "mooncake:kv_inflight_at_prefill_end_bytes", "KV bytes for decode still queued on the prefill when it "
            "reported the first token (layer-wise transfer keeps this near one layer of the last chunk).",
            buckets=(0, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28), registry=r)
        self.writes_dropped = Gauge("mooncake:kv_writes_dropped", "Write-backs to a store a worker dropped (too many "
                                    "in flight).", ["node"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
