"""The conductor's sections, split by concern: ``[conductor]`` (where roles reach it, how it places
requests), ``[admission]`` (SLOs, queue and request bounds, how long a request may take),
``[liveness]`` (dead and stalled nodes, draining) and ``[replication]`` (hot blocks). The last three
were ``[conductor]`` keys: the old place still works, with a warning (``config.MOVED_FROM_CONDUCTOR``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mooncake.config_section import Section


class ConductorConfig(Section):
    """The conductor: where roles reach it, and how it places requests (policy, stores, pipeline groups)."""

    endpoint: str = Field("tcp://127.0.0.1:5550", description="ZeroMQ endpoint the roles connect to.")
    frontend: Literal["auto", "on", "off"] = Field("auto", description="Serve the OpenAI API ([frontend]) from the conductor's process too (the same code as mooncake serve --role frontend). off: only frontends of their own serve it, and the conductor answers health probes and /metrics on [node] health_port. auto: on, except under [coordination] (conductors that fail over for each other run no frontend: two on one host would want the same port).")

    policy: Literal["cache_aware", "least_loaded", "round_robin", "random"] = Field(
        "cache_aware", description="Prefill selection policy (random: a uniform draw; a baseline).")
    use_store: bool = Field(True, description="Read prefixes from store nodes and write new blocks to them.")
    store_writes: Literal["reused", "all"] = Field("reused", description="Which blocks go to the stores: reused, a block once its prefix recurs (a prompt mostly made of a recurring prefix, or a session's, whole, with its decode's blocks; a prompt new from its first block while the workload reuses), so that a workload with no reuse writes nothing (README \"What goes to the stores\"); all: every block a prefill computes and every block a decode completes.")
    cpp_group_size: int = Field(1, ge=1, le=16, description="Chunked pipeline parallelism: prefill instances form pipeline groups of this many stages (each a range of layers; a long prompt's chunks, 1/stages of [engine] prefill_chunk_tokens each, flow through them). 1: off, every prefill alone.")
    cpp_min_tokens: int = Field(2048, ge=1, description="Prompts with at least this many tokens to compute may use a pipeline group (when its predicted TTFT beats the best single instance); shorter ones never do.")

    def serves_frontend(self, coordinated: bool) -> bool:
        return self.frontend == "on" or (self.frontend == "auto" and not coordinated)


class AdmissionConfig(Section):
    """What the cluster admits (the conductor judges each request's plan): the SLOs, the queue and
    request bounds, and how long a request may take and move. ``[classes.<class>]`` overrides the
    per-class ones."""

    ttft_slo_ms: float = Field(0.0, ge=0, description="Time-to-first-token SLO; 0: no early rejection on TTFT.")
    tbt_slo_ms: float = Field(0.0, ge=0, description="Time-between-tokens SLO; 0: no early rejection on TBT.")
    max_queue_wait_s: float = Field(2.0, ge=0, description="A request predicted to wait longer than this before its prompt computes (behind the prompts queued on the instance that would serve it, or for KV room to decode in) is refused at once with 429 and a Retry-After, rather than queued: past its capacity the cluster keeps serving what it admits in time instead of letting every queue grow (goodput plateaus rather than collapses). The longer a request's own prefill, the less of it it may wait (this squared over this plus its prefill time): the requests that cost most are refused first. Applies to the classes with no ttft_slo_ms (that SLO judges the wait itself); [classes.flex] waits without it by default. 0: queue up to max_waiting.")
    max_retry_after_s: float = Field(60.0, ge=1, description="Upper bound of the Retry-After a rejection carries.")
    probe_after_s: float = Field(5.0, gt=0, description="After rejecting every request on SLO predictions for this long, admit one to re-measure.")
    max_waiting: int = Field(256, ge=1, description="Requests queued for prefill cluster-wide before new ones get 503 (a request with n choices counts n).")
    max_requests: int = Field(1024, ge=1, description="Requests in flight cluster-wide before new ones get 503 (a request with n choices counts n).")
    request_timeout_s: float = Field(300.0, gt=0, description="A request with no progress this long moves to other instances (a migration), then fails.")
    max_migrations: int = Field(2, ge=0, description="Times a request may move after its worker fails, dies or stalls.")


class LivenessConfig(Section):
    """How a live node is told from a dead or stalled one, and how long a stopping role drains."""

    heartbeat_s: float = Field(1.0, gt=0, description="Heartbeat interval the roles are told to use.")
    dead_after_s: float = Field(3.0, gt=0, description="A node silent this long is dead.")
    stall_after_s: float = Field(60.0, gt=0, description="An engine instance with work but no engine progress this long is unhealthy: its requests move elsewhere.")
    drain_timeout_s: float = Field(30.0, ge=0, description="On SIGTERM, a role lets its in-flight requests finish for up to this long.")


class ReplicationConfig(Section):
    """Hot blocks copied to more stores."""

    hot_block_hits: int = Field(4, ge=1, description="Hits in the window that make a block hot.")
    hot_window_s: float = Field(60.0, gt=0, description="Sliding window for hot-block counting.")
    replicas: int = Field(1, ge=1, description="Store copies wanted of a hot block.")
