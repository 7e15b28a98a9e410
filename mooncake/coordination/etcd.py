"""A small asyncio client of etcd's v3 HTTP/JSON gateway (``/v3/...``, etcd >= 3.4): leases and the
election service. Keys and values travel base64-encoded, as the gateway wants. Every call
tries the configured endpoints in turn (any member of an etcd cluster answers), and raises
``EtcdUnavailable`` when none does."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import httpx

log = logging.getLogger(__name__)


class EtcdUnavailable(RuntimeError):
    """No etcd endpoint answered (or the one that did refused the call)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text or "")


class Etcd:
    def __init__(self, endpoints: list[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._first = 0  # the endpoint that answered last: asked first next time

    async def call(self, path: str, body: dict, timeout_s: float | None = -1.0) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers; its JSON answer.
        ``timeout_s``: -1 the client's default, None no limit (a campaign waits to lead)."""
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            k = (self._first + i) % n
            url = f"{self.endpoints[k]}/v3/{path}"
            try:
                r = await self._http.post(url, content=json.dumps(body),
                                          timeout=self.timeout_s if timeout_s == -1.0 else timeout_s)
            except httpx.HTTPError as e:
                errors.append(f"{self.endpoints[k]}: {type(e).__name__}")
                continue
            if r.status_code != 200:
                raise EtcdUnavailable(f"etcd {url} answered {r.status_code}: {r.text[:200]}")
            self._first = k
            # a streaming call (keepalive, campaign) answers one JSON object per line: the first is ours
            answer = json.loads(r.text.splitlines()[0]) if r.text else {}
            if "error" in answer:
                raise EtcdUnavailable(f"etcd {url}: {answer['error']}")
            return answer.get("result", answer)
        raise EtcdUnavailable("no etcd endpoint answered (" + "; ".join(errors) + ")")

    # ------------------------------------------------------------ leases

    async def grant(self, ttl_s: int) -> str:
        """A new lease of ``ttl_s`` seconds; its id (a decimal string, as the gateway gives it)."""
        return str((await self.call("lease/grant", {"TTL": int(ttl_s)}))["ID"])

    async def keepalive(self, lease: str) -> int:
        """Refresh the lease; the seconds it has left (0: it had expired, it is gone)."""
        return int((await self.call("lease/keepalive", {"ID": lease})).get("TTL", 0))

    async def revoke(self, lease: str) -> None:
        await self.call("lease/revoke", {"ID": lease})

    # ------------------------------------------------------------ election

    async def campaign(self, name: bytes, lease: str, value: bytes) -> dict:
        """Wait until this lease leads the election ``name`` (announcing ``value``); the leader key."""
        answer = await self.call("election/campaign", {"name": _b64(name), "lease": lease, "value": _b64(value)},
                                 timeout_s=None)
        return answer["leader"]

    async def leader(self, name: bytes) -> bytes | None:
        """What the leader of ``name`` announced; None while nobody leads."""
        try:
            answer = await self.call("election/leader", {"name": _b64(name)})
        except EtcdUnavailable as e:
            if "no leader" in str(e):
                return None
            raise
        kv = answer.get("kv")
        return _unb64(kv.get("value", "")) if kv else None

    async def resign(self, leader: dict) -> None:
        await self.call("election/resign", {"leader": leader})

    async def close(self) -> None:
        await self._http.aclose()
