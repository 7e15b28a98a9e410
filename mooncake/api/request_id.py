"""X-Request-Id: taken from the client (sanitized) or made up, echoed on the response, put in
the ASGI scope (``request.state.request_id``: the conductor leads the request's id with it,
so every role's log lines about the request carry it) and in a context variable for the
conductor's own logs. With ``access_log``, one log line per HTTP request. Plain ASGI, like
the guard, so the app still sees client disconnects."""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from typing import Any

HEADER = b"x-request-id"
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
access_log = logging.getLogger("mooncake.access")


def clean_request_id(value: str) -> str:
    """A client's id made safe for ids and logs: [A-Za-z0-9._:-], at most 64 characters."""
    return _UNSAFE.sub("", value)[:64]


class RequestId:
    def __init__(self, app: Any, log_access: bool = False, recent: Any = None) -> None:
        """``recent``: the frontend's finished requests (``RecentRequests``): a completion's line
        carries its timeline (``frontend/timeline.py``), which it gets its HTTP time added to."""
        self.app = app
        self.log_access = log_access
        self.recent = recent
        if log_access:
            access_log.setLevel(logging.INFO)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == HEADER), "")
        rid = clean_request_id(given) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        token = current_request_id.set(rid)
        t0, status, started = time.perf_counter(), [0], time.monotonic()

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            current_request_id.reset(token)
            fields = self._timeline(scope, rid, started)
            if self.log_access:
                timeline = "".join(f" {k}={v}" for k, v in fields.items())
                access_log.info("%s %s %d %.3fs request_id=%s%s", scope.get("method"), scope.get("path"), status[0],
                                time.perf_counter() - t0, rid, timeline, extra={"fields": fields})

    def _timeline(self, scope: dict, rid: str, started: float) -> dict:
        """The breakdown of the completion request this HTTP request served ({} for any other)."""
        req = scope.get("state", {}).get("mooncake_request")
        if req is None or not req.timeline.finished:
            return {}
        fields = req.timeline.around(started, time.monotonic())
        if self.recent is not None:
            kept = self.recent.get(req.req_id)
            if kept is not None:
                kept.update(fields)
                self.recent.alias(rid, req.req_id)
        return fields
