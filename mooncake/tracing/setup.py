"""One OpenTelemetry tracer per role: its own ``TracerProvider`` and ``Resource``
(``service.name`` = ``mooncake-<role>``), so that a process hosting two roles (a conductor
serving the API) names each one's spans apart. Spans are batched and posted over OTLP/HTTP to
``{otlp_endpoint}/v1/traces``; a parent-based sampler keeps ``trace_sample_ratio`` of new traces.
Without an endpoint: ``None``, and nothing of the SDK is imported."""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING

from mooncake.config_observability import ObservabilityConfig

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

_lock = threading.Lock()
_providers: dict[tuple[str, str, float], object] = {}  # (role, endpoint, ratio) -> its TracerProvider


def role_tracer(obs: ObservabilityConfig, role: str) -> "Tracer | None":
    """The tracer of ``role``'s spans; None when tracing is off (no endpoint)."""
    if not obs.otlp_endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    key = (role, obs.otlp_endpoint, obs.trace_sample_ratio)
    with _lock:
        provider = _providers.get(key)
        if provider is None:
            provider = TracerProvider(resource=Resource.create({"service.name": f"mooncake-{role}"}),
                                      sampler=ParentBased(TraceIdRatioBased(obs.trace_sample_ratio)))
            exporter = OTLPSpanExporter(endpoint=f"{obs.otlp_endpoint}/v1/traces", timeout=5)
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=obs.trace_export_delay_ms))
            if not _providers:
                atexit.register(shutdown_all)
            _providers[key] = provider
    return provider.get_tracer("mooncake")  # type: ignore[attr-defined]


def flush_all(timeout_ms: int = 5000) -> None:
    """Post every role's finished spans now."""
    for provider in list(_providers.values()):
        provider.force_flush(timeout_ms)  # type: ignore[attr-defined]


def shutdown_all() -> None:
    """Flush and stop every role's exporter (at exit)."""
    with _lock:
        providers = list(_providers.values())
        _providers.clear()
    for provider in providers:
        provider.shutdown()  # type: ignore[attr-defined]
