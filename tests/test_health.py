"""Probes: a frontend's /health, /health/live, /health/ready; the workers' and stores'
small health server ([node] health_port) and the `mooncake probe` exec probe."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
from fastapi import FastAPI

from mooncake.api.health import add_health_routes
from mooncake.config import Config
from mooncake.roles.node_health import NodeHealth, probe_url, start_node_health
from mooncake.testing.ports import free_port


class _Frontend:
    """What the health routes read: the conductor's last node counts, and whether it can serve."""

    def __init__(self) -> None:
        self.nodes: dict[str, int] = {}

    def node_counts(self) -> dict[str, int]:
        return self.nodes

    @property
    def ready(self) -> bool:
        n = self.nodes.get
        return n("colocated", 0) > 0 or (n("prefill", 0) > 0 and n("decode", 0) > 0)


async def test_frontend_live_always_ready_only_with_prefill_and_decode_or_colocated():
    frontend = _Frontend()
    app = FastAPI()
    add_health_routes(app, frontend)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.get("/health/live")).status_code == 200
        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "not ready"
        old = await client.get("/health")
        assert old.status_code == 503 and old.json() == {"status": "starting",
                                                        "nodes": {"prefill": 0, "decode": 0, "colocated": 0,
                                                                  "store": 0, "frontend": 0}}
        frontend.nodes.update(prefill=1)
        assert (await client.get("/health/ready")).status_code == 503  # no decode yet
        frontend.nodes.update(decode=1, store=2, frontend=1)
        assert (await client.get("/health/ready")).status_code == 200
        assert (await client.get("/health")).json() == {"status": "ok", "nodes": {"prefill": 1, "decode": 1,
                                                                                  "colocated": 0, "store": 2,
                                                                                  "frontend": 1}}
        frontend.nodes["decode"] = 0  # workers away: not ready, still live
        assert (await client.get("/health/ready")).status_code == 503
        assert (await client.get("/health/live")).status_code == 200
        frontend.nodes["colocated"] = 1  # a colocated instance serves alone
        assert (await client.get("/health/ready")).status_code == 200


async def test_node_health_server_answers_live_then_ready():
    health = NodeHealth("decode", "n1-decode")
    port = await health.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            live = await client.get("/health/live")
            assert live.status_code == 200 and live.json()["node_id"] == "n1-decode"
            assert (await client.get("/health/ready")).status_code == 503
            health.ready = True
            ready = await client.get("/health/ready?verbose=1")
            assert ready.status_code == 200 and ready.json()["role"] == "decode"
            assert (await client.get("/nope")).status_code == 404
            assert (await client.post("/health/live")).status_code == 405
            assert (await client.head("/health/live")).status_code == 200
    finally:
        await health.close()


async def test_node_health_survives_garbage_and_silent_clients():
    health = NodeHealth("store", "s")
    port = await health.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\xff\xfe garbage\r\n\r\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.0 405 ")
        writer.close()
        _, silent = await asyncio.open_connection("127.0.0.1", port)  # connects, never sends
        writer2 = silent
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/health/live")).status_code == 200
        writer2.close()
    finally:
        await health.close()


async def test_health_port_zero_serves_nothing():
    health = await start_node_health(Config(), "prefill", "p")
    assert health.port == 0 and health._server is None


def test_probe_url_of_each_role():
    cfg = Config()
    cfg.frontend.host, cfg.frontend.port = "0.0.0.0", 8000
    assert probe_url(cfg, "conductor", "live") == "http://127.0.0.1:8000/health/live"
    cfg.node.host, cfg.node.health_port = "10.1.1.1", 8081
    assert probe_url(cfg, "decode", "ready") == "http://10.1.1.1:8081/health/ready"
    cfg.node.health_port = 0
    with pytest.raises(ValueError, match="health_port is 0"):
        probe_url(cfg, "store", "ready")


def _probe(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run([sys.executable, "-m", "mooncake.cli", "probe", *args], capture_output=True,
                          text=True, env={**base, **env}, timeout=60)


async def test_exec_probe_exit_codes():
    health = NodeHealth("store", "s")
    port = await health.start("127.0.0.1", 0)
    env = {"MOONCAKE_NODE_HEALTH_PORT": str(port)}
    try:
        r = await asyncio.to_thread(_probe, "--role", "store", "--check", "live", **env)
        assert r.returncode == 0, r.stderr
        r = await asyncio.to_thread(_probe, "--role", "store", **env)
        assert r.returncode == 1 and "503" in r.stderr
        health.ready = True
        r = await asyncio.to_thread(_probe, "--role", "store", **env)
        assert r.returncode == 0 and "ready" in r.stdout
    finally:
        await health.close()
    r = await asyncio.to_thread(_probe, "--role", "store", **env)  # nobody serves: not healthy
    assert r.returncode == 1
    r = await asyncio.to_thread(_probe, "--role", "decode")  # no health port configured
    assert r.returncode == 2 and "health_port" in r.stderr
    r = await asyncio.to_thread(_probe, "--role", "conductor", MOONCAKE_CONDUCTOR_PORT=str(free_port()))
    assert r.returncode == 1
