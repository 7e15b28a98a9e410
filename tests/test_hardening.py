"""Hardening of a live dev cluster: fuzzed HTTP input (schemathesis), explicit bad input,
API key, cache_salt isolation, and a graceful shutdown (SIGTERM drains the running stream,
every process exits 0). Malformed ZeroMQ messages: test_malformed.py.
Shapes: the pair only: bad input, keys and SIGTERM are the frontend's and every role's alike (keys,
salts and a restart in each shape: test_restart_and_keys.py)."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL, stream
from mooncake.testing.cluster import running_cluster, small_config

pytestmark = pytest.mark.timeout(180)

KEY = "test-secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("hardening"), api_key=KEY, max_body_bytes=BODY_LIMIT,
                       request_timeout_s=60.0, drain_timeout_s=20.0)
    cfg.engine.max_model_len = 512  # a small context: clamped max_tokens stay cheap
    with running_cluster(cfg=cfg) as c:
        yield c


def post(c: LocalCluster, body: object, path: str = "/v1/completions", headers: dict | None = None,
         **kw: object) -> httpx.Response:
    headers = AUTH if headers is None else headers
    if isinstance(body, bytes):
        return httpx.post(c.url + path, content=body, timeout=60,
                          headers={**headers, "content-type": "application/json"}, **kw)
    return httpx.post(c.url + path, json=body, headers=headers, timeout=60, **kw)


def ok(c: LocalCluster) -> dict:
    r = post(c, {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---------------------------------------------------------------- HTTP


def test_api_key_is_required_on_the_api(cluster):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert_error(post(cluster, body, headers={}), 401)
    assert_error(post(cluster, body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(post(cluster, body, headers={"Authorization": KEY}), 401)
    assert httpx.get(cluster.url + "/v1/models").status_code == 401
    assert post(cluster, body).status_code == 200
    for probe in ("/health", "/health/live", "/health/ready"):  # probes need no key
        assert httpx.get(cluster.url + probe).status_code == 200


def test_oversized_body_is_413_with_or_without_content_length(cluster):
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 * BODY_LIMIT)}).encode()
    assert_error(post(cluster, big), 413)

    def chunks():  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = httpx.post(cluster.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert_error(r, 413)
    ok(cluster)


@pytest.mark.parametrize("body,param", [
    (b'{"model": "\xff\xfe", "prompt": "hi"}', None),  # invalid UTF-8
    (b'\xc3\x28', None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),  # rejected, not clamped
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": -2}, "top_k"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**70}, "seed"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "cache_salt": "s" * 1000}, "cache_salt"),
    ({"model": MODEL, "prompt": [-1]}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], [3]]}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop"),
    ([1, 2, 3], None),
    ("just a string", None),
])
def test_bad_input_is_400_and_the_server_keeps_serving(cluster, body, param):
    err = assert_error(post(cluster, body), 400)
    if param is not None:
        assert (err["param"] or "").startswith(param), err
    ok(cluster)


def test_max_tokens_within_the_schema_bound_is_clamped_to_the_context(cluster):
    body = {"model": MODEL, "prompt": list(range(1000, 1500)), "max_tokens": 1_000_000, "temperature": 0,
            "ignore_eos": True}
    r = post(cluster, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 512 - 500
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_cache_salts_never_share_blocks(cluster):
    prompt = list(range(4000, 4100))  # 6 full blocks
    def cached(salt: str | None, tail: int) -> int:
        body = {"model": MODEL, "prompt": prompt + [tail], "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = post(cluster, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a", 1) == 0
    assert cached("tenant-b", 2) == 0
    assert cached(None, 3) == 0
    assert cached("tenant-a", 4) >= 96
    assert cached("tenant-b", 5) >= 96
    assert cached(None, 6) >= 96


def test_fuzzed_requests_never_get_a_5xx(cluster):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    raw = httpx.get(cluster.url + "/openapi.json", headers=AUTH, timeout=10).json()
    schema = schemathesis.openapi.from_dict(raw)
    failures: list[str] = []
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                nonlocal ran
                ran += 1
                resp = case.call(base_url=cluster.url, headers=AUTH, timeout=30)
                if resp.status_code >= 500:
                    failures.append(f"{op.label} {mode.value}: {resp.status_code} {resp.text[:200]} "
                                    f"for {case.body!r:.300}")

            try:
                run()
            except Unsatisfiable:  # no invalid input exists (a GET without parameters)
                assert mode == schemathesis.GenerationMode.NEGATIVE
    assert ran > 100
    assert not failures, "\n".join(failures[:10])
    ok(cluster)


# ---------------------------------------------------------------- shutdown (a cluster of its own)


def test_sigterm_drains_the_running_stream_and_every_process_exits_0(tmp_path):
    cfg = small_config(tmp_path, drain_timeout_s=20.0)
    with running_cluster(cfg=cfg) as c:
        body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        conductor = c.children["conductor"]
        events = stream(c.url, body, lambda n, _: os.killpg(conductor.pid, signal.SIGTERM) if n == 2 else None)
        assert events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert events[-2]["usage"]["completion_tokens"] == 30
        assert conductor.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(c.url + "/health", timeout=2)
        c.stop(grace_s=30)
        codes = {name: p.returncode for name, p in c.children.items()}
        assert codes == {name: 0 for name in codes}, codes
