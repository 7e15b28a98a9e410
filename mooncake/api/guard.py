"""The HTTP guard: API keys, and a body-size limit, as plain ASGI middleware.

With API keys configured (``[frontend] api_key`` and ``api_keys``) every path
needs ``Authorization: Bearer <key>`` except the probes (``/health*``), which
load balancers and Kubernetes call without credentials; ``/cluster`` and
``/metrics`` (Prometheus scrapes with ``bearer_token``) are guarded like the API.
Keys are compared in constant time (``hmac.compare_digest``, every key tried).
The key that matched goes to the app in the ASGI scope (``scope["state"]
["api_key"]``, read by routes as ``request.state.api_key``), for the per-key
cache salt.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so that the app still sees the
client's disconnect: a request whose client went away is freed everywhere.
Bodies are limited both by their declared Content-Length and, for chunked
uploads, by counting bytes as the app reads them.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Sequence

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from mooncake.api.errors import error_body

OPEN_PATHS = ("/health",)  # and everything under it: /health/live, /health/ready


def matching_key(header: str, keys: Sequence[bytes]) -> bytes | None:
    """The configured key that ``header`` ("Bearer <key>") presents, or None; constant time in the
    presented key, and every configured key is compared (no early exit that times which matched)."""
    scheme, _, token = header.partition(" ")
    presented = token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
    found = None
    for key in keys:
        if hmac.compare_digest(presented, key) and presented:
            found = key
    return found


def key_salt(api_key: str, cache_salt: str) -> str:
    """The cache salt of a request under ``salt_per_api_key``: a hash of the caller's key, with the
    request's own ``cache_salt`` after it (tenants never share blocks; within a tenant, salts still
    separate). The key itself never reaches the hash chain or the logs."""
    tenant = hashlib.sha256(b"mooncake/api-key\0" + api_key.encode()).hexdigest()[:32]
    return f"key:{tenant}\0{cache_salt}"


def request_salt(salt_per_api_key: bool, scope: dict, cache_salt: str) -> str:
    """The cache salt a request is submitted with: its own, or under ``salt_per_api_key`` the one
    derived from the key the guard authenticated (``key_salt``)."""
    api_key = scope.get("state", {}).get("api_key", "")
    return key_salt(api_key, cache_salt) if salt_per_api_key and api_key else cache_salt


class Guard:
    def __init__(self, app: Any, api_keys: Sequence[str], limit: int) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys if k]
        self.limit = limit

    def _open(self, path: str) -> bool:
        return not self.keys or any(path == p or path.startswith(p + "/") for p in OPEN_PATHS)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self._open(scope["path"]):
            key = matching_key(headers.get("authorization", ""), self.keys)
            if key is None:
                await JSONResponse(error_body(401, "missing or invalid API key", code="invalid_api_key"), 401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = key.decode()
        too_big = JSONResponse(error_body(413, f"request body over {self.limit} bytes"), 413)
        size = headers.get("content-length", "")
        if size.isdigit() and int(size) > self.limit:
            await too_big(scope, receive, send)
            return
        seen, over = 0, False

        async def counted() -> dict:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        async def reply(message: dict) -> None:  # whatever the app made of the overflow, answer 413
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await too_big(scope, receive, send)

        await self.app(scope, counted, reply)
