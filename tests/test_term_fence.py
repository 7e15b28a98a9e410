"""One term per leadership, fencing stale leaders (issue 52): a leader's term rides on what it
orders, and workers, stores and frontends refuse an older term than the newest they have seen —
not acted on, counted, logged once per stale term. Term 0 (no election) passes only until a
nonzero term is seen. The fence itself, then each recipient over real sockets: a worker's link
(what the conductor sends workers arrives there), a store's server (the conductor's store orders)
sharing its fence with the store's link, a frontend's conductor client; and the conductor's side
(its messages and store orders carry its term, the nodes' refusals reach its metrics)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.conductor import Conductor
from mooncake.config import Config, StoreConfig
from mooncake.frontend.conductor_client import ConductorClient
from mooncake.kv.integrity import checksums
from mooncake.metrics import Metrics
from mooncake.protocol.p2p import Forget
from mooncake.roles.conductor_link import ConductorLink
from mooncake.sockets import recv_multipart, send_multipart
from mooncake.term_fence import TermFence
from mooncake.tiers.client import StoreClient, StoreError
from mooncake.tiers.server import StoreServer
from mooncake.tiers.tiered import TieredStore

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20
ROUTE = P.Route(P.WorkerRef("d0", "decode", "tcp://127.0.0.1:4"), [P.WorkerRef("p0", "prefill", "tcp://127.0.0.1:3")],
                b"k" * 16)


def refused(metrics: Metrics, node: str, message: str) -> float:
    return metrics.registry.get_sample_value("mooncake:stale_term_refused_total",
                                             {"node": node, "message": message}) or 0.0


# ---------------------------------------------------------------- the fence


def test_the_fence_keeps_the_newest_term_and_refuses_older_ones(caplog):
    metrics = Metrics()
    fence = TermFence("w0", metrics.stale_term_refused)
    assert fence.admit(P.Abort("a#1"))  # term 0 while none was seen: a conductor without etcd
    assert fence.admit(P.Abort("a#1", term=5)) and fence.term == 5
    assert fence.admit(P.Registered("w0", 1.0, term=5))  # the same term again: the same leader
    with caplog.at_level(logging.WARNING, logger="mooncake.term_fence"):
        assert not fence.admit(P.Abort("a#2", term=3))
        assert not fence.admit(P.FrontendGone("f0", term=3))
        assert not fence.admit(P.Abort("a#3"))  # term 0 once a term was seen
        assert not fence.admit(P.Abort("a#4", term=3))
    assert fence.term == 5
    assert fence.refused == {"Abort": 3, "FrontendGone": 1}
    assert refused(metrics, "w0", "Abort") == 3 and refused(metrics, "w0", "FrontendGone") == 1
    stale = [r for r in caplog.records if "refuses" in r.getMessage()]
    assert len(stale) == 2  # once for term 3, once for term 0: not once per message
    assert fence.admit(P.Heartbeat("w0")) and fence.admit(P.ClusterView("c0"))  # no term field: not fenced
    assert fence.admit(P.Admitted("r#1", ROUTE, term=9)) and not fence.admit(P.Admitted("r#1", ROUTE, term=5))
    assert fence.refused["Admitted"] == 1 and fence.term == 9


def test_term_rides_the_wire_and_zero_is_left_out():
    """An old peer (no ``term`` field) decodes what a new one sends under no election, unchanged."""
    for msg in (P.Abort("a"), P.Registered("n", 1.0), P.Keep([b"h"], 1.0), P.Admitted("r", ROUTE)):
        assert b"term" not in P.encode(msg)[0]
    for msg in (P.Abort("a", term=7), P.FrontendGone("f", term=7), P.Remove([b"h"], 7), P.Replicate([b"h"], "t", 7),
                P.Keep([b"h"], 1.0, "", 7), Forget("o", term=7), P.Refused("r", 429, "x", "y", term=7),
                P.AttemptEnded("r", "retry", "m", term=7), P.Registered("n", 1.0, term=7)):
        assert P.decode(P.encode(msg))[0] == msg


# ---------------------------------------------------------------- a worker's link to the conductor


@pytest.fixture
async def router(tmp_path):
    """A ZeroMQ ROUTER standing in for the conductor, and its endpoint."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/conductor"
    sock.bind(endpoint)
    yield ctx, sock, endpoint
    sock.close(0)
    ctx.term()


async def registers(sock: zmq.asyncio.Socket) -> tuple[bytes, P.Register]:
    while True:
        ident, *frames = await recv_multipart(sock)
        msg, _ = P.decode(frames)
        if isinstance(msg, P.Register):
            return bytes(ident), msg


async def test_a_worker_refuses_a_stale_leaders_orders_and_registration_answer(router):
    ctx, sock, endpoint = router
    held = ["a#1", "b#1"]
    dropped: list[list[str]] = []

    async def drop(ids: list[str]) -> None:
        dropped.append(ids)

    link = ConductorLink(ctx, endpoint, P.Register("decode", "d0", P.NodeInfo("n0", 1)), P.Load,
                         holding=lambda: list(held), on_orphans=drop)

    async def answer() -> bytes:
        ident, msg = await registers(sock)
        await send_multipart(sock, [ident, *P.encode(P.Registered("d0", 0.5, ["b#1"], term=3))])  # a stale one's ...
        await send_multipart(sock, [ident, *P.encode(P.Registered("d0", 0.5, ["a#1", "b#1"], term=5))])  # ... leader's
        return ident

    try:
        link.fence.check(5, "Registered")  # the worker heard term 5 before (from the leader, elsewhere)
        ident, _ = await asyncio.gather(answer(), link.connect(timeout_s=10))
        await asyncio.sleep(0.05)
        assert dropped == [] and link.fence.refused == {"Registered": 1}  # the stale keep dropped nothing
        for msg in (P.Abort("a#1", term=3), P.FrontendGone("f0", "i0", term=4), P.Abort("b#1"),
                    P.Registered("d0", 0.5, [], term=4), P.Abort("b#1", term=6)):
            await send_multipart(sock, [ident, *P.encode(msg)])
        msg, _ = await asyncio.wait_for(link.recv(), 5)
        assert msg == P.Abort("b#1", term=6)  # the first message acted on: a newer term's
        assert dropped == [] and link.fence.term == 6
        assert link.fence.refused == {"Registered": 2, "Abort": 2, "FrontendGone": 1}
        assert link._load().stale_terms == link.fence.refused  # they ride the heartbeats to the leader
    finally:
        link.close()


# ---------------------------------------------------------------- a store's orders


async def test_a_store_refuses_a_stale_leaders_orders_once_the_new_leader_ordered(tmp_path, router):
    """Two conductors, the old (term 3) still ordering while the new one (term 7) leads: the store
    acts on the old one's orders only until it hears the new term, then refuses them (its data
    untouched); its link to the conductor shares the fence, so a Registered of a newer term fences
    the store orders too."""
    ctx, sock, endpoint = router
    store = TieredStore.from_config(StoreConfig(dram_bytes=16 * MiB, lmdb_bytes=0, data_dir=str(tmp_path)), "s")
    server = StoreServer(store, "tcp://127.0.0.1:0", node_id="s")
    store_endpoint = await server.start()
    old, new = Conductor(Config(), "m"), Conductor(Config(), "m")
    old.leader_term, new.leader_term = 3, 7
    by_old, by_new = old.replicator.client(store_endpoint), new.replicator.client(store_endpoint)
    writer = StoreClient(store_endpoint)
    link = ConductorLink(ctx, endpoint, P.Register("store", "s", P.NodeInfo("n0", 1)), P.Load, fence=server.fence)
    hs, blocks = [bytes([i]) * 32 for i in range(3)], torch.randn(3, 64, 16)
    try:
        assert (by_old.term, by_new.term) == (3, 7)
        assert await writer.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 3
        assert await by_old.keep(hs[:1], 30.0) == 1  # no newer term heard yet: acted on
        assert await by_new.keep(hs[:1], 30.0) == 1
        with pytest.raises(StoreError) as stale:
            await by_old.remove(hs[:1])
        assert stale.value.code == "stale_term"
        with pytest.raises(StoreError, match="older"):
            await by_old.replicate(hs[:1], "tcp://127.0.0.1:1")
        assert await writer.exists(hs) == [True, True, True]  # the old leader's Remove did nothing
        assert server.fence.refused == {"Remove": 1, "Replicate": 1}
        assert await by_new.remove(hs[:1]) == 1

        async def answer() -> None:
            ident, _ = await registers(sock)
            await send_multipart(sock, [ident, *P.encode(P.Registered("s", 0.5, term=9))])
        await asyncio.gather(answer(), link.connect(timeout_s=10))
        assert server.fence.term == 9
        with pytest.raises(StoreError, match="stale_term|older"):
            await by_new.keep(hs[2:], 30.0)  # term 7, now stale
        assert server.fence.refused["Keep"] == 1 and link._load().stale_terms == server.fence.refused
    finally:
        for c in (by_old, by_new, writer):
            c.close()
        link.close()
        await server.close()
        store.close()


async def test_a_store_order_without_a_term_is_refused_once_a_term_was_seen(tmp_path):
    store = TieredStore.from_config(StoreConfig(dram_bytes=16 * MiB, lmdb_bytes=0, data_dir=str(tmp_path)), "s")
    server = StoreServer(store, "tcp://127.0.0.1:0", node_id="s")
    client = StoreClient(await server.start())
    hs, blocks = [bytes([9]) * 32], torch.randn(1, 64, 16)
    try:
        assert await client.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 1
        assert await client.keep(hs, 10.0) == 1  # term 0, none seen: a single conductor without etcd
        server.fence.check(2, "Registered")
        with pytest.raises(StoreError, match="older"):
            await client.remove(hs)
        assert await client.exists(hs) == [True]
        client.term = 2
        assert await client.remove(hs) == 1
    finally:
        client.close()
        await server.close()
        store.close()


# ---------------------------------------------------------------- a frontend's answers


async def test_a_frontend_refuses_a_stale_leaders_answers(router):
    ctx, sock, endpoint = router
    cfg = Config()
    cfg.conductor.endpoint = endpoint
    metrics = Metrics()
    told: list[P.Msg] = []
    client = ConductorClient(cfg, "f0", told.append, metrics)
    register = P.Register("frontend", "f0", P.NodeInfo("n0", 1), {"tokens": "tcp://127.0.0.1:9"})

    async def answer() -> bytes:
        ident, _ = await registers(sock)
        await send_multipart(sock, [ident, *P.encode(P.Registered("f0", 0.5, term=5))])
        return ident

    try:
        ident, _ = await asyncio.gather(answer(), client.connect(ctx, None, register, P.Load, list))
        submit = P.Submit("r#1", "f0", [1, 2, 3], [], b"", P.Sampling(max_tokens=4))
        asking = asyncio.create_task(client.ask(submit))
        while True:  # the Submit arrives (heartbeats may come first)
            _, *frames = await recv_multipart(sock)
            if isinstance(P.decode(frames)[0], P.Submit):
                break
        for msg in (P.Refused("r#1", 429, "overloaded", "busy", term=4), P.Admitted("r#1", ROUTE, 4, term=3),
                    P.Admitted("r#1", ROUTE, 4)):  # a stale leader's answers, one without a term
            await send_multipart(sock, [ident, *P.encode(msg)])
        await asyncio.sleep(0.2)
        assert not asking.done()  # none of them is the answer
        await send_multipart(sock, [ident, *P.encode(P.Admitted("r#1", ROUTE, 4, term=5))])
        assert await asyncio.wait_for(asking, 5) == P.Admitted("r#1", ROUTE, 4, term=5)
        for msg in (P.AttemptEnded("r#1", "retry", "old", term=4), P.AttemptEnded("r#1", "retry", "new", term=8)):
            await send_multipart(sock, [ident, *P.encode(msg)])
        for _ in range(100):
            if told:
                break
            await asyncio.sleep(0.02)
        assert [m.message for m in told] == ["new"] and client.fence.term == 8
        assert refused(metrics, "f0", "Admitted") == 2 and refused(metrics, "f0", "Refused") == 1
        assert refused(metrics, "f0", "AttemptEnded") == 1
        assert P.Load().stale_terms == {} and client.link._load().stale_terms == {}  # counted here, not reported
    finally:
        await client.close()


# ---------------------------------------------------------------- the conductor's side


async def test_the_conductors_messages_carry_its_term_and_nodes_refusals_reach_its_metrics(tmp_path):
    cfg = Config()
    cfg.conductor.endpoint = f"ipc://{tmp_path}/conductor"
    conductor = Conductor(cfg, "m")
    conductor.leader_term = 4
    await conductor.start()
    ctx = zmq.asyncio.Context()
    link = ConductorLink(ctx, cfg.conductor.endpoint, P.Register("store", "s0", P.NodeInfo("n0", 1),
                                                                {"store": "tcp://127.0.0.1:1"}), P.Load)
    try:
        await link.connect(timeout_s=10)
        assert link.fence.term == 4  # the Registered carried it
        conductor._send("s0", Forget("obj"))
        msg, _ = await asyncio.wait_for(link.recv(), 5)
        assert msg == Forget("obj", term=4)
        assert conductor.replicator.client("tcp://127.0.0.1:1").term == 4
        node = conductor.cluster.get("s0")
        conductor.membership.heartbeat(node, P.Load(stale_terms={"Keep": 2}), time.monotonic())
        conductor.membership.heartbeat(node, P.Load(stale_terms={"Keep": 3}), time.monotonic())
        assert refused(conductor.metrics, "s0", "Keep") == 3
    finally:
        link.close()
        await conductor.close()
        ctx.term()
