"""Health of a worker or store process, for Kubernetes probes and load balancers.

``NodeHealth`` serves ``GET /health/live`` (200 while the process serves) and
``GET /health/ready`` (200 once the role is registered with the conductor, 503
before and while it drains) on ``[node] health_port`` with plain asyncio: no web
framework in the workers. A conductor without a frontend serves its ``/metrics`` there too. ``probe`` is the client side, used by
``mooncake probe --role ROLE`` as an exec probe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Callable

from mooncake.config import Config
from mooncake.roles.timing import READ_TIMEOUT_S

log = logging.getLogger(__name__)


class NodeHealth:
    """A tiny HTTP/1.0 server answering the two probe paths; ``ready`` is set by the role."""

    def __init__(self, role: str, node_id: str, metrics: Callable[[], bytes] | None = None) -> None:
        self.role = role
        self.node_id = node_id
        self.metrics = metrics  # renders /metrics (Prometheus text), if this process has any
        self.ready = False
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("%s health on http://%s:%d/health/{live,ready}", self.node_id, host, self.port)
        return self.port

    def answer(self, path: str) -> tuple[int, dict | bytes]:
        """Status and body (JSON, or the metrics' text) for ``path``."""
        if path == "/metrics" and self.metrics is not None:
            return 200, self.metrics()
        if path == "/health/live":
            return 200, {"status": "ok", "role": self.role, "node_id": self.node_id}
        if path == "/health/ready":
            ok = self.ready
            return (200 if ok else 503), {"status": "ready" if ok else "not ready", "role": self.role,
                                          "node_id": self.node_id}
        return 404, {"error": f"no such path: {path}; use /health/live or /health/ready"}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            while (await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.decode("latin-1").split()
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                status, body = 405, {"error": "only GET"}
            else:
                status, body = self.answer(parts[1].split("?", 1)[0])
            text = isinstance(body, bytes)
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            kind = "text/plain; version=0.0.4" if text else "application/json"
            writer.write(f"HTTP/1.0 {status} {reason}\r\nContent-Type: {kind}\r\n"
                         f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                         + (b"" if parts[:1] == ["HEAD"] else payload))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeDecodeError, IndexError):
            pass  # a broken probe connection is the prober's problem
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def start_node_health(cfg: Config, role: str, node_id: str,
                            metrics: Callable[[], bytes] | None = None) -> NodeHealth:
    """A NodeHealth, serving on ``[node] health_port`` when that is set (0: not served)."""
    health = NodeHealth(role, node_id, metrics)
    if cfg.node.health_port:
        await health.start(cfg.node.host, cfg.node.health_port)
    return health


def probe_url(cfg: Config, role: str, check: str) -> str:
    """Where the probe of ``role`` asks: the frontend's HTTP port (the conductor's in-process
    frontend, if it runs one), or the node's health port."""
    coordinated = bool(cfg.coordination.etcd_endpoints)
    if role == "frontend" or (role == "conductor" and cfg.conductor.serves_frontend(coordinated)):
        host, port = cfg.frontend.host, cfg.frontend.port
    else:
        if not cfg.node.health_port:
            raise ValueError(f"{role}: [node] health_port is 0 (MOONCAKE_NODE_HEALTH_PORT); nothing to probe")
        host, port = cfg.node.host, cfg.node.health_port
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/health/{check}"


def probe(cfg: Config, role: str, check: str = "ready", timeout_s: float = 3.0) -> tuple[bool, str]:
    """Ask the role's health endpoint; (healthy, what it said)."""
    url = probe_url(cfg, role, check)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return True, f"{url}: {r.status} {r.read().decode(errors='replace')}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code} {e.read().decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {e}"
