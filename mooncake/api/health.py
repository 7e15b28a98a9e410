"""A frontend's health endpoints, for load balancers and Kubernetes probes.

- ``/health/live``: the process serves HTTP (a liveness probe must not restart the
  frontend because workers or the conductor are away).
- ``/health/ready``: a prefill and a decode instance, or a colocated one, are registered.
- ``/health``: the readiness answer with the number of nodes per role (JSON).
"""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse

ROLES = ("prefill", "decode", "colocated", "store", "frontend")


class _Frontend(Protocol):
    def node_counts(self) -> dict[str, int]: ...

    @property
    def ready(self) -> bool: ...


def add_health_routes(app: FastAPI, frontend: _Frontend) -> None:
    """Register /health, /health/live and /health/ready on ``app``."""

    def nodes() -> dict[str, int]:
        counts = frontend.node_counts()
        return {r: counts.get(r, 0) for r in ROLES}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = frontend.ready
        return JSONResponse({"status": "ok" if ok else "starting", "nodes": nodes()}, 200 if ok else 503)

    @app.get("/health/live")
    async def live() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        ok = frontend.ready
        return JSONResponse({"status": "ready" if ok else "not ready", "nodes": nodes()}, 200 if ok else 503)
