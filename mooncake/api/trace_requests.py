"""The frontend's root span of each completion request (``[observability] otlp_endpoint``): it
continues the client's W3C ``traceparent`` header, else starts a trace, and lasts until the
response (an SSE stream included) is out. Plain ASGI, outermost; without a tracer the app itself
runs (nothing is added)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mooncake.tracing import span

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

TRACED = ("/v1/completions", "/v1/chat/completions")


def trace_requests(app: Any, tracer: "Tracer | None") -> Any:
    """``app`` with a span per completion request; ``app`` itself without a tracer."""
    if tracer is None:
        return app

    async def traced(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in TRACED:
            await app(scope, receive, send)
            return
        parent = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"traceparent"), None)
        status = [0]

        async def sent(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        with span(tracer, f"{scope.get('method')} {scope['path']}", parent,
                  {"http.request.method": scope.get("method", ""), "url.path": scope["path"]}) as s:
            try:
                await app(scope, receive, sent)
            finally:
                s.set_attribute("http.response.status_code", status[0])
                req = scope.get("state", {}).get("mooncake_request")
                if req is not None:
                    s.set_attribute("mooncake.request_id", req.req_id)
                    s.set_attribute("mooncake.request_class", req.sampling.request_class)
    return traced
