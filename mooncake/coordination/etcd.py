"""A small asyncio client of etcd's v3 HTTP/JSON gateway (``/v3/...``, etcd >= 3.4): leases and the
election service. Keys and values travel base64-encoded, as the gateway wants.

It fails safe: every call tries the configured endpoints in turn (any member of an etcd cluster
answers) and takes the first answer that is a 200 with a JSON body holding what the caller needs;
a member that cannot be reached, answers an error or a body that does not parse is skipped for the
next. When no member gives such an answer the call raises ``EtcdUnavailable``, whatever went
wrong (never another exception); every call has a time limit.
Why our own and not a library: the Python etcd v3 clients (python-etcd3 and its asyncio fork
``aetcd``, not yet 1.0) speak gRPC, a native dependency (grpcio, protobuf) for a few calls, and
their APIs have no election calls (Campaign, Leader, Observe), which this uses; the gateway needs
only httpx, which the server has anyway. It is tested against real etcd processes
(``test_leader_stepdown.py``, ``test_etcd_cluster.py``) and a gateway that misbehaves on purpose
(``test_etcd_failsafe.py``)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import Any, Callable, TypeVar

import httpx

log = logging.getLogger(__name__)

T = TypeVar("T")
NO_LEADER = "election: no leader"  # what etcd answers (an error) while nobody leads an election


class EtcdUnavailable(RuntimeError):
    """No etcd endpoint gave a usable answer (unreachable, an error, or a body that does not parse)."""


class EtcdTimedOut(EtcdUnavailable):
    """No member answered within the call's limit (a campaign still waiting to lead, too)."""


class BadAnswer(ValueError):
    """A member's answer lacks what the call needs (the member is skipped)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text or "", validate=True)


def _int(answer: dict, key: str, default: int | None = None) -> int:
    """``answer[key]`` as an int (the gateway writes int64s as strings, and omits zeros)."""
    value = answer.get(key, default)
    if value is None:
        raise BadAnswer(f"no {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadAnswer(f"{key!r} is not an integer: {value!r}")
    return int(value)


class Etcd:
    def __init__(self, endpoints: list[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._first = 0  # the endpoint that answered last: asked first next time

    async def call(self, path: str, body: dict, read: Callable[[dict[str, Any]], T] = lambda a: a,
                   timeout_s: float | None = None) -> T:
        """POST ``body`` to ``/v3/<path>`` on each endpoint in turn; ``read`` of the first usable
        answer (its JSON object; it raises on one that lacks what the caller needs, and that
        member is skipped). ``timeout_s`` (default the client's) bounds each endpoint's try."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        errors, timeouts = [], 0
        n = len(self.endpoints)
        for i in range(n):
            k = (self._first + i) % n
            try:
                result = read(await asyncio.wait_for(self._ask(self.endpoints[k], path, body, limit), limit))
            except Exception as e:  # anything that went wrong with this member: the next one
                timeouts += isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException))
                errors.append(f"{self.endpoints[k]}: {type(e).__name__} {str(e)[:200]}".rstrip())
                continue
            self._first = k
            return result
        unavailable = EtcdTimedOut if timeouts == n else EtcdUnavailable
        raise unavailable(f"no etcd endpoint answered /v3/{path} (" + "; ".join(errors) + ")")

    async def _ask(self, endpoint: str, path: str, body: dict, timeout_s: float) -> dict[str, Any]:
        """One member's answer: its JSON object (a streaming call's first line: ours)."""
        r = await self._http.post(f"{endpoint}/v3/{path}", content=json.dumps(body), timeout=timeout_s)
        if r.status_code != 200:
            raise BadAnswer(f"answered {r.status_code}: {r.text[:200]}")
        lines = r.text.splitlines()
        answer = json.loads(lines[0]) if lines else None
        if not isinstance(answer, dict):
            raise BadAnswer(f"not a JSON object: {r.text[:200]!r}")
        if "error" in answer:
            raise BadAnswer(f"error: {answer['error']}")
        result = answer.get("result", answer)
        if not isinstance(result, dict):
            raise BadAnswer(f"not a JSON object: {r.text[:200]!r}")
        return result

    # ------------------------------------------------------------ leases

    async def grant(self, ttl_s: int) -> str:
        """A new lease of ``ttl_s`` seconds; its id (a decimal string, as the gateway gives it)."""
        return await self.call("lease/grant", {"TTL": int(ttl_s)}, lambda a: str(_int(a, "ID")))

    async def keepalive(self, lease: str, timeout_s: float | None = None) -> int:
        """Refresh the lease; the seconds it has left (0: it had expired, it is gone), counted from
        when the request reached etcd. ``timeout_s`` bounds each member's try."""
        def read(answer: dict) -> int:
            if str(_int(answer, "ID")) != lease:
                raise BadAnswer(f"keepalive answered for lease {answer['ID']}, not {lease}")
            return _int(answer, "TTL", 0)
        return await self.call("lease/keepalive", {"ID": lease}, read, timeout_s)

    async def revoke(self, lease: str) -> None:
        await self.call("lease/revoke", {"ID": lease})

    # ------------------------------------------------------------ election

    async def campaign(self, name: bytes, lease: str, value: bytes, timeout_s: float) -> dict:
        """Wait up to ``timeout_s`` until this lease leads the election ``name`` (announcing
        ``value``); the leader key, verified: etcd names this lease as the leader's, with a
        revision. Campaigning again with the same lease resumes the same key."""
        def read(answer: dict) -> dict:
            leader = answer.get("leader")
            if not isinstance(leader, dict) or not isinstance(leader.get("key"), str) or not leader["key"]:
                raise BadAnswer(f"no leader key in {answer!r:.200}")
            if str(_int(leader, "lease")) != lease or _int(leader, "rev") <= 0 or leader.get("name") != _b64(name):
                raise BadAnswer(f"the leader key is not this campaign's: {leader!r:.200}")
            return leader
        return await self.call("election/campaign", {"name": _b64(name), "lease": lease, "value": _b64(value)},
                               read, timeout_s)

    async def leader(self, name: bytes) -> bytes | None:
        """What the leader of ``name`` announced; None while nobody leads."""
        def read(answer: dict) -> bytes | None:
            kv = answer.get("kv")  # etcd answers an error, never a 200 without it, while nobody leads
            if not isinstance(kv, dict) or not isinstance(kv.get("value", ""), str):
                raise BadAnswer(f"no leader value in {answer!r:.200}")
            return _unb64(kv.get("value", ""))
        try:
            return await self.call("election/leader", {"name": _b64(name)}, read)
        except EtcdUnavailable as e:
            if NO_LEADER in str(e):
                return None
            raise

    async def resign(self, leader: dict) -> None:
        await self.call("election/resign", {"leader": leader})

    async def close(self) -> None:
        await self._http.aclose()
