"""A trace crosses processes as the W3C ``traceparent`` string (``00-<trace id>-<span id>-<flags>``):
in the client's HTTP header, and in one optional field (``trace``) of the messages that start a
request's work in a role (``Submit``, ``PrefillRequest``, ``DecodeRequest``, the store's reads and
writes)."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


def current_traceparent() -> str | None:
    """The ``traceparent`` of the span current in this context; None outside any recorded span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_of(traceparent: str | None) -> Any:
    """The OpenTelemetry context a ``traceparent`` names as parent (None: no parent, a new trace)."""
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})
