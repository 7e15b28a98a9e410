"""A leader steps down before its lease could lapse (issue 52, finding 3): its lease is proven
until the send time of its last keepalive answered + the TTL - a margin, and once that passes
``lost`` is set — even while a keepalive hangs — so it stops acting before etcd could expire the
lease and let another lead. A healthy etcd keeps it leading; the same lease proven again lets it
lead again under the same term; a lease etcd says is gone never does. Against the fake gateway
of ``test_etcd_failsafe`` and a real etcd (frozen with SIGSTOP)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import types

import pytest

from mooncake.conductor import Conductor
from mooncake.conductor.snapshot import cluster_snapshot
from mooncake.config import Config, CoordinationConfig
from mooncake.coordination import election
from mooncake.coordination.election import Candidate, lease_margin_s, proven_until
from mooncake.testing.etcd import EtcdServer
from mooncake.testing.ports import free_port
from test_etcd_failsafe import GRANTED, HANG, KEPT, LEASE, FakeEtcd, coordination, won

pytestmark = pytest.mark.timeout(60)

GONE = (200, json.dumps({"result": {"ID": LEASE}}))  # etcd's answer to a keepalive of a lapsed lease: no TTL


@pytest.fixture
def gateway():
    started = []

    def start(cfg: CoordinationConfig, **answers: tuple[int, str]) -> FakeEtcd:
        started.append(FakeEtcd({"lease/grant": GRANTED, "lease/keepalive": KEPT, "election/campaign": won(cfg),
                                 **{k.replace("_", "/"): v for k, v in answers.items()}}))
        cfg.etcd_endpoints = [started[-1].url]
        return started[-1]
    yield start
    for server in started:
        server.close()


def record_keepalives(candidate: Candidate) -> list[tuple[float, int]]:
    """(when it was sent, the TTL answered) of each keepalive that was answered."""
    answered, keepalive = [], candidate.etcd.keepalive

    async def recorded(lease: str, timeout_s: float | None = None) -> int:
        sent = asyncio.get_running_loop().time()
        left = await keepalive(lease, timeout_s)
        answered.append((sent, left))
        return left
    candidate.etcd.keepalive = recorded
    return answered


def record_lost(candidate: Candidate) -> list[float]:
    lost_at: list[float] = []
    candidate.on_lost = lambda: lost_at.append(asyncio.get_running_loop().time())
    return lost_at


def test_the_margin_leaves_a_healthy_leader_several_keepalives():
    assert proven_until(10.0, 5) == 14.0 and proven_until(0.0, 2) == 1.5 and lease_margin_s(60) == 12
    for ttl in range(2, 301):  # every TTL the config allows: a margin, and room for two keepalives sent
        assert 0.5 <= lease_margin_s(ttl) < ttl and proven_until(0.0, ttl) > 2 * ttl / 3


async def test_a_hung_keepalive_sets_lost_by_proven_until(gateway):
    cfg = coordination()
    fake = gateway(cfg)
    candidate = Candidate(cfg, "c1", "tcp://127.0.0.1:1")
    answered, lost_at = record_keepalives(candidate), record_lost(candidate)
    assert await asyncio.wait_for(candidate.win(), 2.0) and candidate.term == 3  # the campaign key's revision
    await asyncio.sleep(1.0)  # a keepalive or two answered
    fake.answers["lease/keepalive"] = HANG
    await asyncio.wait_for(candidate.lost.wait(), cfg.lease_ttl_s * 2)
    last_sent = max(sent for sent, left in answered if left > 0)
    assert lost_at[0] <= candidate.proven_until + 0.3  # when proven_until passed (a loop's lateness)...
    assert lost_at[0] < last_sent + cfg.lease_ttl_s  # ... before etcd could expire the lease
    await candidate.close()


async def test_lost_is_set_while_a_keepalive_call_still_hangs(gateway):
    cfg = coordination()
    gateway(cfg)
    candidate = Candidate(cfg, "c1", "tcp://127.0.0.1:1")
    lost_at, calls = record_lost(candidate), []

    async def never_answered(lease: str, timeout_s: float | None = None) -> int:
        calls.append(asyncio.get_running_loop().time())
        await asyncio.Event().wait()
        return 2
    assert await asyncio.wait_for(candidate.win(), 2.0)
    candidate.etcd.keepalive = never_answered
    granted_until = candidate.proven_until
    await asyncio.wait_for(candidate.lost.wait(), cfg.lease_ttl_s * 2)
    assert len(calls) == 1 and lost_at[0] <= granted_until + 0.3 and not candidate.proven()
    await candidate.close()


async def test_a_healthy_gateway_keeps_the_leader_leading(gateway):
    cfg = coordination()
    gateway(cfg)
    candidate = Candidate(cfg, "c1", "tcp://127.0.0.1:1")
    answered = record_keepalives(candidate)
    assert await asyncio.wait_for(candidate.win(), 2.0)
    for _ in range(3 * cfg.lease_ttl_s * 10):  # three TTLs
        await asyncio.sleep(0.1)
        assert candidate.proven() and not candidate.lost.is_set()
    assert len(answered) >= 6
    await candidate.close()


async def test_a_lease_proven_again_leads_again_under_the_same_term_and_a_gone_one_never(gateway):
    cfg = coordination()
    fake = gateway(cfg, lease_keepalive=HANG)
    candidate = Candidate(cfg, "c1", "tcp://127.0.0.1:1")
    assert await asyncio.wait_for(candidate.win(), 2.0)
    await asyncio.wait_for(candidate.lost.wait(), cfg.lease_ttl_s * 2)
    fake.answers["lease/keepalive"] = KEPT  # etcd back (restarted, say): the lease was never lost there
    assert await asyncio.wait_for(candidate.win(same_lease=True), 5.0)
    assert candidate.term == 3 and candidate.proven() and not candidate.lost.is_set()
    fake.answers["lease/keepalive"] = GONE
    await asyncio.wait_for(candidate.lost.wait(), cfg.lease_ttl_s * 2)
    assert not await asyncio.wait_for(candidate.win(same_lease=True), 5.0)
    await candidate.close()


async def test_a_conductor_whose_lease_is_not_proven_stops_acting_at_once(gateway, monkeypatch):
    """The role: its socket is closed in the very step ``lost`` is set (``close()`` would take a
    flush first); the lease proven again: a new Conductor under the same term; etcd saying the
    lease is gone: the process exits 1."""
    from mooncake.roles import conductor as role

    conductors, candidates, exits = [], [], []

    class Recorded(Conductor):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            conductors.append(self)

    class Recording(Candidate):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            candidates.append(self)

    def exit_(code: int) -> None:
        exits.append(code)
        raise asyncio.CancelledError  # (SystemExit would stop the test's event loop)
    monkeypatch.setattr(role, "Conductor", Recorded)
    monkeypatch.setattr(role, "Candidate", Recording)
    monkeypatch.setattr(role, "resolve_model_dir", lambda model: (None, "m"))
    monkeypatch.setattr(role, "expected_model", lambda cfg: None)
    monkeypatch.setattr(role, "sys", types.SimpleNamespace(exit=exit_))
    monkeypatch.setattr(role.gc, "freeze", lambda: None)
    cfg = Config()
    cfg.conductor.endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg.coordination.lease_ttl_s = 2
    fake = gateway(cfg.coordination)
    run = asyncio.create_task(role.run_conductor(cfg))

    async def until(check) -> None:
        for _ in range(100):
            if check():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("not in 5 s")
    await until(lambda: conductors and conductors[-1].router is not None)
    snapshot = cluster_snapshot(conductors[0])
    assert snapshot["leader"] == cfg.node.name and snapshot["leader_term"] == 3
    fake.answers["lease/keepalive"] = HANG
    await asyncio.wait_for(candidates[0].lost.wait(), 4.0)
    assert conductors[0].router.sock.sock.closed  # nothing handled or sent from here on
    fake.answers["lease/keepalive"] = KEPT
    await until(lambda: len(conductors) == 2 and conductors[1].router is not None)
    assert conductors[1].leader_term == 3 and not conductors[1].router.sock.sock.closed
    fake.answers["lease/keepalive"] = GONE
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 5.0)
    assert exits == [1] and conductors[1].router.sock.sock.closed and len(conductors) == 2


async def test_a_leader_whose_etcd_hangs_stops_acting_before_its_lease_could_lapse(monkeypatch):
    monkeypatch.setattr(election, "CAMPAIGN_TIMEOUT_S", 1.0)  # the standby campaigns again meanwhile
    server = EtcdServer()  # raises (the test fails) where etcd is not installed
    server.start()
    try:
        cfg = CoordinationConfig(etcd_endpoints=[server.url], lease_ttl_s=2, prefix="/mooncake/stepdown-test")
        first, second = Candidate(cfg, "c1", "tcp://127.0.0.1:1"), Candidate(cfg, "c2", "tcp://127.0.0.1:2")
        assert await asyncio.wait_for(first.win(), 10)
        standby = asyncio.create_task(second.win())
        answered, lost_at = record_keepalives(first), record_lost(first)
        await asyncio.sleep(1.0)
        os.kill(server.proc.pid, signal.SIGSTOP)  # etcd hangs: nothing answers, nothing fails
        try:
            await asyncio.wait_for(first.lost.wait(), cfg.lease_ttl_s * 2)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        last_sent = max(sent for sent, left in answered if left > 0)
        assert lost_at[0] < last_sent + cfg.lease_ttl_s
        term = first.term
        if await asyncio.wait_for(first.win(same_lease=True), 10):  # its lease outlived the freeze
            assert first.term == term
        await first.close()  # revokes the lease if it leads again: the standby leads
        assert await asyncio.wait_for(standby, 10) and second.term > term  # a later leader's term is higher
        await second.close()
    finally:
        server.stop()


async def test_a_conductor_that_stops_acting_takes_back_its_metric_refreshers():
    """A leader that leads again builds a new Conductor on the same metrics: the old one's gauge
    refreshers (which hold it, its cluster and its index) go when it closes."""
    from mooncake.metrics import Metrics

    metrics = Metrics("m")
    before = len(metrics.before_render)
    for _ in range(3):
        c = Conductor(Config(), "m", None, metrics)
        assert len(metrics.before_render) == before + 2
        await c.close()
    assert len(metrics.before_render) == before
    metrics.render()
