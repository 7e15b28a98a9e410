"""The HTTP guard: API key on /v1/*, and a body-size limit, as plain ASGI middleware.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so that the app still sees the
client's disconnect: a request whose client went away is freed everywhere.
Bodies are limited both by their declared Content-Length and, for chunked
uploads, by counting bytes as the app reads them.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from mooncake.api.errors import error_body


class Guard:
    def __init__(self, app: Any, api_key: str, limit: int) -> None:
        self.app = app
        self.api_key = api_key
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].startswith("/v1/") and \
                headers.get("authorization", "") != f"Bearer {self.api_key}":
            await JSONResponse(error_body(401, "missing or invalid API key", code="invalid_api_key"), 401)(
                scope, receive, send)
            return
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
