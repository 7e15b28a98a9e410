"""The conductor's health endpoints, for load balancers and Kubernetes probes.

- ``/health/live``: the process serves HTTP (a liveness probe must not restart the
  conductor because workers are away).
- ``/health/ready``: at least one prefill and one decode instance are registered.
- ``/health``: the readiness answer with the number of nodes per role (JSON).
"""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse

ROLES = ("prefill", "decode", "store")


class _Cluster(Protocol):
    def of_role(self, role: str) -> list: ...


class _Conductor(Protocol):
    cluster: _Cluster

    @property
    def ready(self) -> bool: ...


def add_health_routes(app: FastAPI, conductor: _Conductor) -> None:
    """Register /health, /health/live and /health/ready on ``app``."""

    def nodes() -> dict[str, int]:
        return {r: len(conductor.cluster.of_role(r)) for r in ROLES}

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = conductor.ready
        return JSONResponse({"status": "ok" if ok else "starting", "nodes": nodes()}, 200 if ok else 503)

    @app.get("/health/live")
    async def live() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        ok = conductor.ready
        return JSONResponse({"status": "ready" if ok else "not ready", "nodes": nodes()}, 200 if ok else 503)
