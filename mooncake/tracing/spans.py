"""Spans that cost nothing when tracing is off: with no tracer, ``span`` returns one shared
do-nothing context manager (no span object is made) and ``record_span`` returns at once.
``record_span`` writes a span after the fact, from timestamps a role kept anyway (a decode's
reservation, a request's first token), so that the hot paths carry no span of their own."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, Mapping

from opentelemetry import trace

from mooncake.tracing.context import context_of

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

_OFF: ContextManager[Any] = nullcontext()
Attrs = Mapping[str, str | int | float | bool]


def span(tracer: "Tracer | None", name: str, parent: str | None = None, attrs: Attrs | None = None,
         start_ns: int | None = None) -> ContextManager[Any]:
    """A span current while the block runs (the child of the current span, or of ``parent``, a
    traceparent, when given); a no-op when ``tracer`` is None."""
    if tracer is None:
        return _OFF
    ctx = context_of(parent) if parent else None
    return tracer.start_as_current_span(name, context=ctx, attributes=attrs, start_time=start_ns)


def mono_ns(t: float) -> int:
    """A ``time.monotonic()`` instant as wall-clock nanoseconds (what spans are stamped with)."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def record_span(tracer: "Tracer | None", name: str, start: float, end: float, parent: "str | Span | None" = None,
                attrs: Attrs | None = None, events: list[tuple[str, float]] | None = None) -> "Span | None":
    """A finished span from ``start`` to ``end`` (``time.monotonic()``), the child of ``parent`` (a
    traceparent or a span; None: of the current span); ``events``: (name, instant) pairs."""
    if tracer is None:
        return None
    ctx = trace.set_span_in_context(parent) if parent is not None and not isinstance(parent, str) else \
        context_of(parent)
    s = tracer.start_span(name, context=ctx, attributes=attrs, start_time=mono_ns(start))
    for event, at in events or ():
        s.add_event(event, timestamp=mono_ns(at))
    s.end(end_time=mono_ns(max(start, end)))
    return s
