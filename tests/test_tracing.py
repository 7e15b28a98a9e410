"""OpenTelemetry traces across the roles, the per-request timeline and its endpoint (issue 55):
a streamed chat completion sent with a client's ``traceparent`` makes one trace, posted by every
role's own exporter to a real OTLP/HTTP receiver (``OTLPSink``), with spans of the frontend,
conductor, prefill and decode (or colocated) and store, each under its role's service name and
each parented inside the trace; the access log's breakdown sums to the request's wall time and
``GET /v1/requests/{id}`` returns it."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from mooncake.config import Config
from mooncake.frontend.recent_requests import RecentRequests
from mooncake.frontend.timeline import COMPONENTS, Timeline
from mooncake.testing.api import MODEL, stream
from mooncake.testing.cluster import SHAPES, running_cluster, small_config
from mooncake.testing.otlp_sink import OTLPSink

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
KEY = "sk-tracing-test"


@pytest.fixture(scope="module")
def sink():
    s = OTLPSink()
    yield s
    s.close()


@pytest.fixture(scope="module", params=list(SHAPES))
def traced_cluster(request, sink, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MOONCAKE_LOG_FORMAT", "json")  # the roles' lines (the access log's) as JSON objects
    cfg = small_config(tmp_path_factory.mktemp("data"))
    cfg.observability.otlp_endpoint = sink.endpoint
    cfg.observability.trace_export_delay_ms = 100
    cfg.frontend.access_log = True
    cfg.frontend.api_key = KEY
    try:
        with running_cluster(cfg=cfg, **SHAPES[request.param]) as c:
            c.shape = request.param
            yield c
    finally:
        mp.undo()


def _chat(url: str, n: int, trace_id: str, span_id: str, request_id: str) -> list:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea. " * n}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    headers = {"traceparent": f"00-{trace_id}-{span_id}-01", "Authorization": f"Bearer {KEY}",
               "X-Request-Id": request_id}
    return stream(url, body, path="/v1/chat/completions", headers=headers)


def _wait_for(sink: OTLPSink, trace_id: str, services: set[str], names: set[str], timeout: float = 20.0) -> list:
    """The trace's spans once every one of ``services`` and ``names`` is in (spans leave in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = sink.trace(trace_id)
        if (services <= {s.service for s in spans} and names <= {s.name for s in spans}) or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def test_one_streamed_chat_completion_is_one_trace_across_the_roles(traced_cluster, sink):
    worker = {"colocated": {"mooncake-colocated"}, "pair": {"mooncake-prefill", "mooncake-decode"}}[traced_cluster.shape]
    services = {"mooncake-frontend", "mooncake-conductor", "mooncake-store", *worker}
    trace_id = CLIENT_TRACE[:-4] + ("c010" if traced_cluster.shape == "colocated" else "9a12")
    events = _chat(traced_cluster.url, 8, trace_id, CLIENT_SPAN, f"trace-{traced_cluster.shape}")
    assert events[-1] == "[DONE]"
    role = "colocated" if traced_cluster.shape == "colocated" else "decode"
    spans = _wait_for(sink, trace_id, services, {"POST /v1/chat/completions", f"{role}.decode_steps", "conductor.attempt"})
    by_service = {s.service for s in spans}
    assert services <= by_service, (by_service, [(s.service, s.name) for s in spans])
    assert all(s.trace_id == trace_id for s in spans)
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id == CLIENT_SPAN]
    assert [s.name for s in roots] == ["POST /v1/chat/completions"] and roots[0].service == "mooncake-frontend"
    orphans = [(s.service, s.name, s.parent_id) for s in spans if s.parent_id != CLIENT_SPAN and s.parent_id not in ids]
    assert not orphans  # every span's parent is in the trace
    names = {(s.service, s.name) for s in spans}
    assert {("mooncake-frontend", "frontend.plan"), ("mooncake-frontend", "frontend.template_tokenize"),
            ("mooncake-frontend", "frontend.stream"), ("mooncake-conductor", "conductor.attempt"),
            ("mooncake-conductor", "conductor.admit_place")} <= names
    attempt = next(s for s in spans if s.name == "conductor.attempt")
    assert attempt.attrs["mooncake.predicted_ttft_s"] > 0 and attempt.attrs["mooncake.measured_ttft_s"] > 0
    assert "mooncake.ttft_prediction_ratio" in attempt.attrs and attempt.attrs["mooncake.candidates"] >= 1
    steps = next((s for s in spans if s.name == f"{role}.decode_steps"), None)
    assert steps is not None, [(s.name, s.attrs) for s in spans if s.service == f"mooncake-{role}"]
    assert steps.attrs["mooncake.decode_steps"] >= 1 and sum(s.name == f"{role}.decode_steps" for s in spans) == 1
    if traced_cluster.shape == "pair":
        assert {"prefill.request", "prefill.queue_wait", "prefill.prefix_load"} <= {s.name for s in spans}
    store = [s for s in spans if s.service == "mooncake-store"]
    assert all(s.attrs["mooncake.store.tiers"] and "mooncake.store.bytes" in s.attrs for s in store)
    frontend = [s for s in spans if s.service == "mooncake-frontend"]
    assert all(s.attrs.get("mooncake.request_id", "x").startswith(f"trace-{traced_cluster.shape}") for s in frontend
               if "mooncake.request_id" in s.attrs)
    m = httpx.get(traced_cluster.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "mooncake:ttft_prediction_ratio_count" in m


def test_the_timeline_sums_to_the_wall_time_in_the_access_log_and_its_endpoint(traced_cluster, capfd):
    rid = f"timeline-{traced_cluster.shape}"
    t0 = time.monotonic()
    _chat(traced_cluster.url, 4, CLIENT_TRACE[:-4] + "7777", CLIENT_SPAN, rid)
    wall = time.monotonic() - t0
    auth = {"Authorization": f"Bearer {KEY}"}
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{traced_cluster.url}/v1/requests/{rid}", headers=auth)
        if (r.status_code == 200 and "respond_s" in r.json()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    got = r.json()
    parts = sum(got.get(f"{c}_s", 0.0) for c in COMPONENTS)
    assert abs(parts - got["wall_s"]) <= 0.05 * got["wall_s"], got
    assert got["wall_s"] <= wall and got["decode_steps"] >= 1 and got["ttft_s"] > 0 and got["prefix_from"]
    assert got["id"].startswith(rid) and httpx.get(f"{traced_cluster.url}/v1/requests/{got['id']}", headers=auth).json() == got
    assert httpx.get(f"{traced_cluster.url}/v1/requests/nope", headers=auth).status_code == 404
    assert httpx.get(f"{traced_cluster.url}/v1/requests/{rid}").status_code == 401
    time.sleep(0.5)
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    access = [x for x in lines if x.get("logger") == "mooncake.access" and f"request_id={rid} " in x["message"]]
    assert access, "no JSON access log line for the request"
    line = access[-1]
    assert abs(sum(line.get(f"{c}_s", 0.0) for c in COMPONENTS) - line["wall_s"]) <= 0.05 * line["wall_s"], line
    assert {"queue_s", "decode_s", "ttft_s", "decode_steps", "preemptions", "migrations", "prefix_from"} <= set(line)


def test_a_timeline_partitions_the_time_of_a_preempted_request():
    t = Timeline(arrived=10.0)
    t.prefilled(placed=10.1, reserved=10.2, now=11.0, prefill_s=0.5, fetch_s=0.1, cached_tokens=16, fetched_blocks=1,
                first=True)
    t.tokens(1, 11.2)
    t.tokens(1, 11.3)
    t.moved(preempted=True, now=11.5)
    t.prefilled(placed=11.7, reserved=11.8, now=12.0, prefill_s=0.1, fetch_s=0.0, cached_tokens=0, fetched_blocks=0,
                first=False)
    t.tokens(2, 12.4)
    t.finish(12.5)
    b = t.around(started=9.9, ended=12.6)
    assert abs(sum(b.get(f"{c}_s", 0.0) for c in COMPONENTS) - b["wall_s"]) < 1e-6 and b["wall_s"] == pytest.approx(2.7)
    assert b["prefix_load_s"] == pytest.approx(0.1) and b["prefix_from"] == "store" and b["preemptions"] == 1
    assert b["decode_steps"] == 4 and b["ttft_s"] == pytest.approx(1.0) and b["retry_s"] == pytest.approx(0.4)


def test_recent_requests_are_bounded_in_time_and_count():
    r = RecentRequests(keep_s=10, max_kept=2)
    r.put("old", {}, now=time.monotonic() - 11)
    r.put("r0", {"i": 0})
    assert r.get("old") is None and r.get("r0") == {"i": 0}
    for i in range(1, 3):
        r.put(f"r{i}", {"i": i})
    r.alias("client-2", "r2")
    assert r.get("r0") is None and r.get("r1") == {"i": 1} and r.get("client-2") == {"i": 2}


def test_tracing_is_off_by_default_and_costs_no_span():
    from mooncake.tracing import record_span, role_tracer, span

    cfg = Config()
    assert cfg.observability.otlp_endpoint == "" and role_tracer(cfg.observability, "frontend") is None
    assert span(None, "x") is span(None, "y")  # one shared no-op: no span object is made
    assert record_span(None, "x", 0.0, 1.0) is None
