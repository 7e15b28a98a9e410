"""The etcd client fails safe (issue 52): whatever a member answers — nothing, an error, a body that
does not parse or lacks what the call needs — the call raises ``EtcdUnavailable`` or gets its answer
from the next member; a campaign never wins on such an answer, a leader whose keepalive fails steps
down, and the leader watch keeps following. Against a fake gateway on a free port (and one real
etcd, where a member answering 500 comes first)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mooncake.config import Config, ConfigError, CoordinationConfig, load_config
from mooncake.coordination import election
from mooncake.coordination.election import Candidate, LeaderWatch, election_key
from mooncake.coordination.etcd import Etcd, EtcdUnavailable
from mooncake.testing.etcd import EtcdServer
from mooncake.testing.ports import free_port

pytestmark = pytest.mark.timeout(60)

LEASE = "7"
GRANTED = (200, json.dumps({"ID": LEASE, "TTL": "2"}))
KEPT = (200, json.dumps({"result": {"ID": LEASE, "TTL": "2"}}))
BAD = {"non-JSON": (200, "<html>ok</html>"), "truncated": (200, '{"ID": "7", "TT'), "empty": (200, ""),
       "HTTP 500": (500, '{"error": "etcdserver: leader changed"}'), "a JSON list": (200, "[1, 2]"),
       "missing fields": (200, '{"header": {}}'), "wrong types": (200, '{"ID": [7], "leader": "me"}')}
HANG = (0, "")  # an answer that never comes (the request hangs until the gateway closes)


def coordination(*urls: str) -> CoordinationConfig:
    return CoordinationConfig(etcd_endpoints=list(urls), lease_ttl_s=2, poll_s=0.05)


def won(cfg: CoordinationConfig, lease: str = LEASE) -> tuple[int, str]:
    """A campaign's answer naming ``lease`` the leader's, as etcd gives it."""
    name = base64.b64encode(election_key(cfg)).decode()
    return 200, json.dumps({"leader": {"name": name, "key": "a2V5", "rev": "3", "lease": lease}})


class FakeEtcd:
    """A stand-in gateway: ``answers[path]`` is (status, body) for ``/v3/<path>``, or ``HANG``."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers, self.asked = answers, []
        self.closing = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path = self.path.removeprefix("/v3/")
                fake.asked.append(path)
                status, body = fake.answers.get(path, (404, "no such path"))
                if (status, body) == HANG:
                    fake.closing.wait()
                    return
                self.send_response(status)
                self.send_header("Content-Length", str(len(body.encode())))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    started = []

    def start(**answers: tuple[int, str]) -> FakeEtcd:
        started.append(FakeEtcd({k.replace("_", "/"): v for k, v in answers.items()}))
        return started[-1]
    yield start
    for server in started:
        server.close()


@pytest.mark.parametrize("answer", BAD.values(), ids=BAD.keys())
async def test_a_bad_answer_is_etcd_unavailable_and_never_a_win(fake, answer):
    cfg = coordination()
    etcd = Etcd([fake(lease_grant=answer, lease_keepalive=answer, election_campaign=answer,
                      election_leader=answer).url], timeout_s=1.0)
    for call in (etcd.grant(2), etcd.keepalive(LEASE), etcd.campaign(election_key(cfg), LEASE, b"v", 1.0),
                 etcd.leader(election_key(cfg))):
        with pytest.raises(EtcdUnavailable):
            await call
    await etcd.close()


@pytest.mark.parametrize("bad", ["grant without ID", "non-JSON", "truncated", "HTTP 500", "another lease"])
async def test_a_campaign_answered_badly_never_leads(fake, bad):
    cfg = coordination()
    grant = (200, '{"TTL": "2"}') if bad == "grant without ID" else GRANTED
    campaign = won(cfg, lease="8") if bad == "another lease" else BAD.get(bad, won(cfg))
    cfg.etcd_endpoints = [fake(lease_grant=grant, lease_keepalive=KEPT, election_campaign=campaign).url]
    candidate = Candidate(cfg, "c1", "tcp://127.0.0.1:1")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(candidate.win(), 1.5)
    await candidate.close()


@pytest.mark.parametrize("endpoint", ["http//127.0.0.1:2379", "ftp://127.0.0.1:2379", "http://[::1"])
async def test_a_malformed_endpoint_is_etcd_unavailable(endpoint):
    etcd = Etcd([endpoint], timeout_s=1.0)
    with pytest.raises(EtcdUnavailable, match="no etcd endpoint answered"):
        await etcd.grant(2)
    await etcd.close()


@pytest.mark.parametrize("first", ["HTTP 500", "non-JSON", "missing fields", "nothing listens"])
async def test_an_erroring_member_is_skipped_for_the_next(fake, first):
    bad = f"http://127.0.0.1:{free_port()}" if first == "nothing listens" else fake(lease_grant=BAD[first]).url
    good = fake(lease_grant=GRANTED)
    etcd = Etcd([bad, good.url], timeout_s=1.0)
    assert await etcd.grant(2) == LEASE
    assert await etcd.grant(2) == LEASE and good.asked == ["lease/grant"] * 2  # the one that answered, first
    await etcd.close()


@pytest.mark.parametrize("keepalive", ["non-JSON", "HTTP 500", "another lease", "raises"])
async def test_a_leader_whose_keepalive_fails_steps_down(fake, keepalive):
    cfg = coordination()
    kept = (200, json.dumps({"result": {"ID": "8", "TTL": "2"}})) if keepalive == "another lease" \
        else BAD.get(keepalive, KEPT)
    cfg.etcd_endpoints = [fake(lease_grant=GRANTED, lease_keepalive=kept, election_campaign=won(cfg)).url]
    candidate = Candidate(cfg, "c1", "tcp://127.0.0.1:1")
    if keepalive == "raises":  # any unforeseen failure: the keepalive must not die leaving it leading
        async def broken(lease: str, timeout_s: float | None = None) -> int:
            raise RuntimeError("boom")
        candidate.etcd.keepalive = broken
    await asyncio.wait_for(candidate.win(), 2.0)
    await asyncio.wait_for(candidate.lost.wait(), cfg.lease_ttl_s * 2)
    await candidate.close()


async def test_the_leader_watch_keeps_following(fake, monkeypatch):
    monkeypatch.setattr(election, "WATCH_BACKOFF_S", 0.05)
    server = fake(election_leader=BAD["non-JSON"])
    followed, failures = [], [1]

    async def follow(endpoint: str) -> None:
        if failures:  # the first change cannot be followed: the watch tries again
            raise OSError(failures.pop())
        followed.append(endpoint)
    watch = LeaderWatch(coordination(server.url), follow)
    watch.leader = {"name": "c0", "endpoint": "tcp://old:1"}
    task = asyncio.create_task(watch.run())
    for answer in ("not JSON", '{"name": 1}', json.dumps({"name": "c1", "endpoint": "tcp://new:1"})):
        await asyncio.sleep(0.3)
        assert not task.done() and not followed and watch.leader["name"] == "c0"
        server.answers["election/leader"] = (200, json.dumps({"kv": {"value": base64.b64encode(answer.encode()).decode()}}))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if followed:
            break
    assert not task.done() and followed == ["tcp://new:1"] and watch.leader["name"] == "c1" and not failures
    task.cancel()
    await watch.close()


def test_a_malformed_endpoint_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="etcd_endpoints.*http//127.0.0.1:2379"):
        load_config(overrides={"coordination": {"etcd_endpoints": ["http//127.0.0.1:2379"]}})
    with pytest.raises(ConfigError, match="MOONCAKE_COORDINATION_ETCD_ENDPOINTS"):
        load_config(env={"MOONCAKE_COORDINATION_ETCD_ENDPOINTS": "http://a:2379,localhost:2379"})


async def test_a_conductor_whose_campaign_failed_never_leads(monkeypatch):
    from mooncake.roles import conductor as role

    class Failing(Candidate):
        async def win(self) -> None:
            raise KeyError("ID")
    monkeypatch.setattr(role, "Candidate", Failing)
    monkeypatch.setattr(role, "resolve_model_dir", lambda model: (None, "m"))
    monkeypatch.setattr(role, "Conductor", lambda *a: pytest.fail("a failed campaign led"))
    cfg = Config()
    cfg.coordination.etcd_endpoints = ["http://127.0.0.1:2379"]
    with pytest.raises(RuntimeError, match="campaign through etcd failed"):
        await role.run_conductor(cfg)


async def test_through_a_member_answering_500_a_real_etcd_elects_one(fake, monkeypatch):
    server = EtcdServer()  # raises (the test fails) where etcd is not installed
    server.start()
    try:
        cfg = coordination(fake(lease_grant=BAD["HTTP 500"]).url, server.url)
        first, second = Candidate(cfg, "c1", "tcp://127.0.0.1:1"), Candidate(cfg, "c2", "tcp://127.0.0.1:2")
        await asyncio.wait_for(first.win(), 10)
        monkeypatch.setattr(election, "CAMPAIGN_TIMEOUT_S", 0.5)  # the standby campaigns again meanwhile
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(second.win(), 2.0)
        watch = LeaderWatch(cfg)
        assert await asyncio.wait_for(watch.first(), 5) == "tcp://127.0.0.1:1"
        await first.close()  # revokes its lease: the standby leads at once
        await asyncio.wait_for(second.win(), 5)
        assert (await watch.current())["name"] == "c2"
        await asyncio.gather(second.close(), watch.close())
    finally:
        server.kill()
