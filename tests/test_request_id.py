"""X-Request-Id in and out, the access log, JSON log lines, request ids led by the client's."""

from __future__ import annotations

import json
import logging

import httpx
from fastapi import FastAPI, Request

from mooncake.api.request_id import RequestId, clean_request_id, current_request_id
from mooncake.frontend.request import request_id as _request_id
from mooncake.logs import JSONFormatter


def app(log_access: bool) -> FastAPI:
    a = FastAPI()
    a.add_middleware(RequestId, log_access=log_access)

    @a.get("/x")
    async def x(request: Request) -> dict:
        logging.getLogger("mooncake.test").warning("inside")
        return {"state": request.state.request_id, "var": current_request_id.get()}

    return a


async def test_request_id_is_echoed_and_seen_by_the_app(caplog):
    transport = httpx.ASGITransport(app=app(log_access=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with caplog.at_level(logging.INFO):
            r = await client.get("/x", headers={"X-Request-Id": "abc#1 <evil>"})
        made = await client.get("/x")
    assert r.headers["x-request-id"] == "abc1evil" == r.json()["state"] == r.json()["var"]
    assert len(made.headers["x-request-id"]) == 32
    access = [rec.getMessage() for rec in caplog.records if rec.name == "mooncake.access"]
    assert access and access[0].startswith("GET /x 200") and "request_id=abc1evil" in access[0]


def test_json_log_lines_carry_the_request_id():
    fmt = JSONFormatter()
    record = logging.LogRecord("mooncake.x", logging.WARNING, __file__, 1, "hello %s", ("you",), None)
    token = current_request_id.set("r-1")
    try:
        line = json.loads(fmt.format(record))
    finally:
        current_request_id.reset(token)
    assert line["message"] == "hello you" and line["request_id"] == "r-1" and line["level"] == "WARNING"
    assert "request_id" not in json.loads(fmt.format(record))


def test_request_ids_are_led_by_the_clients_and_unique():
    a, b = _request_id("trace-7"), _request_id("trace-7")
    assert a.startswith("trace-7-") and a != b and _request_id("").startswith("req-")
    assert clean_request_id("x" * 100) == "x" * 64


def test_roles_log_json_lines_when_asked():
    import os
    import subprocess
    import sys

    code = "from mooncake.logs import setup_logging; import logging; setup_logging('info'); " \
           "logging.getLogger('mooncake.role').info('started %d', 1)"
    env = {**os.environ, "MOONCAKE_LOG_FORMAT": "json"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    line = json.loads(out.stderr.strip().splitlines()[-1])
    assert line["logger"] == "mooncake.role" and line["message"] == "started 1"
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "MOONCAKE_LOG_FORMAT": "xml"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "MOONCAKE_LOG_FORMAT" in bad.stderr
