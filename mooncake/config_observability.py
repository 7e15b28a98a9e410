"""``[observability]``: OpenTelemetry traces of requests across the roles (``mooncake/tracing/``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from mooncake.config_section import Section


class ObservabilityConfig(Section):
    otlp_endpoint: str = Field("", description="OTLP/HTTP base URL of a trace collector (Jaeger, Tempo, an OpenTelemetry Collector), e.g. http://collector:4318: every role posts its spans to its /v1/traces, each role under its own service.name (mooncake-frontend, mooncake-conductor, mooncake-prefill, mooncake-decode, mooncake-colocated, mooncake-store); empty: no tracing, no cost.")
    trace_sample_ratio: float = Field(1.0, ge=0, le=1, description="Share of new traces recorded (by trace id; a client's traceparent that says sampled or not is followed); with otlp_endpoint set.")
    trace_export_delay_ms: int = Field(1000, ge=1, le=60000, description="How long a role batches finished spans before posting them to the collector.")

    @field_validator("otlp_endpoint")
    @classmethod
    def _base_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("otlp_endpoint: an http:// or https:// base URL, such as http://collector:4318")
        return v.removesuffix("/v1/traces")
