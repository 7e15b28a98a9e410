"""A local OTLP/HTTP trace receiver for tests and benchmarks: an HTTP server on a free port that
takes what the SDK's exporter posts to ``/v1/traces`` (protobuf ``ExportTraceServiceRequest``) and
keeps each span as a ``SinkSpan``."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class SinkSpan:
    service: str  # its resource's service.name
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    attrs: dict
    events: tuple[str, ...]
    start_ns: int
    end_ns: int


def _value(v: object) -> object:
    kind = v.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(v, kind) if kind else None


class OTLPSink:
    def __init__(self) -> None:
        self.spans: list[SinkSpan] = []
        self.posts = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces"
                if ok:
                    sink._take(body)
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    def _take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        got = []
        for rs in req.resource_spans:
            service = next((str(_value(a.value)) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(SinkSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        {a.key: _value(a.value) for a in s.attributes},
                                        tuple(e.name for e in s.events), s.start_time_unix_nano, s.end_time_unix_nano))
        with self._lock:
            self.spans += got
            self.posts += 1

    def trace(self, trace_id: str) -> list[SinkSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
