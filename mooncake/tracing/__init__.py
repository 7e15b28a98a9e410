"""OpenTelemetry traces of requests across the roles (``[observability]``): one tracer per role
(``setup.py``), the W3C ``traceparent`` that carries a trace across the ZeroMQ messages
(``context.py``), and spans that cost nothing when tracing is off (``spans.py``)."""

from mooncake.tracing.context import context_of, current_traceparent
from mooncake.tracing.setup import flush_all, role_tracer
from mooncake.tracing.spans import record_span, span

__all__ = ["context_of", "current_traceparent", "flush_all", "record_span", "role_tracer", "span"]
