"""Per-frontend CURVE keys, with real keys on real sockets: a frontend's key cannot order a store
(Keep, Replicate, Remove), cannot register as a worker, cannot re-register another live
frontend's node id; a worker's key (all workers share one) cannot take over another live
worker's node id, yet a restart takes it once the old process leaves or is declared dead;
workers take orders only from frontend keys and stream tokens to the frontend under the key it
ordered with; ``FrontendGone`` reaches draining and stalled workers too."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.conductor import Conductor
from mooncake.config import Config, MiB, StoreConfig
from mooncake.kv.integrity import checksums
from mooncake.roles.conductor_link import ConductorLink
from mooncake.roles.orders import Orders
from mooncake.roles.token_outlets import TokenOutlets
from mooncake.security import Curve, CurveError, generate_keys
from mooncake.sockets import bind_server, connect_client
from mooncake.tiers.client import StoreClient, StoreError
from mooncake.tiers.server import StoreServer
from mooncake.tiers.tiered import TieredStore

pytestmark = pytest.mark.timeout(120)
FACTS = P.ModelFacts("m@x/float32", 16, 128, 1000, (2, 2, 1, 16, 8))
MAX_BYTES = 1 << 20


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """The role keys, and a key of its own for frontends ``a`` and ``b``."""
    d = tmp_path_factory.mktemp("keys")
    generate_keys(d, ["a", "b"])
    return d


def test_each_frontend_loads_its_own_key_and_never_the_conductor_s(keys):
    a, b, conductor = Curve(keys, "frontend", "a"), Curve(keys, "frontend", "b"), Curve(keys, "conductor")
    assert a.public != b.public and conductor.public not in (a.public, b.public)
    assert a.kinds[a.public] == a.kinds[b.public] == "frontend" and a.kinds[conductor.public] == "conductor"
    assert not (keys / "frontend.key_secret").exists()  # named keys only: a frontend of another name has none
    with pytest.raises(CurveError, match="frontend key"):
        Curve(keys, "frontend", "c")


async def test_a_frontend_key_cannot_order_a_store(keys, tmp_path):
    store = TieredStore.from_config(StoreConfig(dram_bytes=16 * MiB, lmdb_bytes=0, data_dir=str(tmp_path)), "s")
    server = StoreServer(store, "tcp://127.0.0.1:0", node_id="s", curve=Curve(keys, "store"))
    endpoint = await server.start()
    frontend = StoreClient(endpoint, curve=Curve(keys, "frontend", "a"), timeout_s=5)
    worker = StoreClient(endpoint, curve=Curve(keys, "prefill"), timeout_s=5)
    conductor = StoreClient(endpoint, curve=Curve(keys, "conductor"), timeout_s=5)
    hs, blocks = [bytes([i]) * 32 for i in range(2)], torch.randn(2, 64, 16)
    try:
        assert await worker.put(hs, blocks, model_id="m", checksums=checksums(blocks)) == 2
        with pytest.raises(StoreError, match="a frontend key may not send Keep"):
            await frontend.keep(hs, 30.0)
        with pytest.raises(StoreError, match="a frontend key may not send Replicate"):
            await frontend.replicate(hs, "tcp://127.0.0.1:1")
        with pytest.raises(StoreError, match="a frontend key may not send Remove"):
            await frontend.remove(hs)
        with pytest.raises(StoreError, match="a frontend key may not send Put"):
            await frontend.put(hs, blocks, model_id="m", checksums=checksums(blocks))
        assert await worker.exists(hs) == [True, True]  # untouched
        assert await conductor.keep(hs[:1], 30.0) == 1  # the conductor's key orders
        assert await conductor.remove(hs) == 2
    finally:
        for client in (frontend, worker, conductor):
            client.close()
        await server.close()


class Peer:
    """A process talking to the conductor over its own DEALER, under a real CURVE key."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, curve: Curve, instance: str) -> None:
        self.instance = instance
        self.curve = curve
        self.sock = connect_client(ctx, zmq.DEALER, curve, "conductor", endpoint, f"peer-{instance}")

    async def register(self, role: str, node_id: str) -> P.Msg:
        endpoints = {"prefill": {"orders": "tcp://127.0.0.1:3"}, "frontend": {"tokens": "tcp://127.0.0.1:9"},
                     "decode": {"kv": "tcp://127.0.0.1:1", "orders": "tcp://127.0.0.1:4"}}[role]
        info = P.NodeInfo("n0", 1, FACTS if role != "frontend" else None, num_blocks=64, instance=self.instance)
        await self.sock.send_multipart(P.encode(P.Register(role, node_id, info, endpoints)))
        return await self.recv(P.Registered, P.Error)

    async def recv(self, *kinds: type) -> P.Msg:
        while True:
            msg, _ = P.decode(await asyncio.wait_for(self.sock.recv_multipart(copy=False), 5))
            if isinstance(msg, kinds):
                return msg

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
async def conductor(keys):
    cfg = Config()
    cfg.security.curve_keys_dir = str(keys)
    cfg.conductor.endpoint = "tcp://127.0.0.1:*"
    c = Conductor(cfg, model_name="m")
    endpoint = await c.start()
    ctx = zmq.asyncio.Context()
    peers: list[Peer] = []

    def peer(kind: str, instance: str, name: str = "") -> Peer:
        peers.append(Peer(ctx, endpoint, Curve(keys, kind, name), instance))
        return peers[-1]

    yield c, peer
    for p in peers:
        p.close()
    await c.close()
    c.curve.stop()
    ctx.term()


def code(reply: P.Msg) -> str:
    return reply.code if isinstance(reply, P.Error) else "registered"


async def test_a_frontend_key_cannot_register_as_a_worker_nor_take_another_frontend_s_id(conductor):
    c, peer = conductor
    a, b = peer("frontend", "a-1", "a"), peer("frontend", "b-1", "b")
    assert code(await a.register("prefill", "p-rogue")) == "unauthorized"  # a frontend key is no worker's
    assert code(await a.register("decode", "d-rogue")) == "unauthorized"
    assert code(await peer("conductor", "c-1").register("frontend", "f-c")) == "unauthorized"  # frontend keys only
    assert code(await a.register("frontend", "fa")) == "registered"
    assert code(await b.register("frontend", "fb")) == "registered"
    assert code(await b.register("frontend", "fa")) == "unauthorized"  # another frontend's live id, another key
    assert code(await peer("frontend", "a-2", "a").register("frontend", "fa")) == "node_id_taken"  # same key, another process
    assert code(await a.register("frontend", "fa")) == "registered"  # the same process again: as before
    assert set(c.cluster.nodes) == {"fa", "fb"} and c.cluster.get("fa").info.instance == "a-1"
    assert c.metrics.refused_registrations.labels("node_id_taken")._value.get() == 2


async def test_a_nodes_messages_count_only_under_the_key_it_registered_with(conductor):
    """Another key that reconnects under a gone connection's routing id is not that node: its
    heartbeats and submits are not taken (it is told to register, which its key cannot)."""
    c, peer = conductor
    a = peer("frontend", "a-1", "a")
    assert code(await a.register("frontend", "fa")) == "registered"
    seen = c.cluster.get("fa").last_seen
    a.close()
    await asyncio.sleep(0.3)
    b = peer("frontend", "a-1", "b")  # the same routing id ("peer-a-1"), frontend b's key
    await b.sock.send_multipart(P.encode(P.Heartbeat("fa", P.Load())))
    assert isinstance(await b.recv(P.Reregister), P.Reregister)
    assert c.cluster.get("fa").last_seen == seen and c.cluster.get("fa").peer.startswith("frontend:")


async def test_a_worker_key_cannot_take_over_a_live_worker_s_id_but_a_restart_gets_it(conductor):
    c, peer = conductor
    first = peer("prefill", "p0-1")
    assert code(await first.register("prefill", "p0")) == "registered"
    assert code(await peer("prefill", "rogue").register("prefill", "p0")) == "node_id_taken"  # the shared worker key
    await first.sock.send_multipart(P.encode(P.Leave("p0")))  # a graceful restart: the old one drains
    await asyncio.sleep(0.3)
    assert c.cluster.get("p0").draining
    assert code(await peer("prefill", "p0-2").register("prefill", "p0")) == "registered"
    assert c.cluster.get("p0").info.instance == "p0-2" and not c.cluster.get("p0").draining
    # killed: refused while the old one counts as alive, taken once it is declared dead
    third = peer("prefill", "p0-3")
    assert code(await third.register("prefill", "p0")) == "node_id_taken"
    c.membership.check(time.monotonic() + c.cfg.liveness.dead_after_s + 1)
    assert c.cluster.get("p0") is None
    assert code(await third.register("prefill", "p0")) == "registered"


async def test_a_restarted_process_registers_once_the_old_one_has_left(conductor, keys):
    """``node_id_taken`` is not final: the link retries until the process it replaces is gone."""
    c, peer = conductor
    old = peer("prefill", "p0-1")
    assert code(await old.register("prefill", "p0")) == "registered"
    ctx = zmq.asyncio.Context()
    info = P.NodeInfo("n0", 1, FACTS, num_blocks=64, instance="p0-2")
    link = ConductorLink(ctx, c.router.endpoint, P.Register("prefill", "p0", info, {"orders": "tcp://127.0.0.1:3"}),
                         P.Load, curve=Curve(keys, "prefill"))
    try:
        connecting = asyncio.create_task(link.connect(timeout_s=20))
        await asyncio.sleep(1.5)
        assert not connecting.done()  # refused so far, retrying
        await old.sock.send_multipart(P.encode(P.Leave("p0")))
        await asyncio.wait_for(connecting, 10)
        assert c.cluster.get("p0").info.instance == "p0-2"
    finally:
        link.close()
        ctx.term()


async def test_frontend_gone_reaches_draining_and_stalled_workers(conductor):
    c, peer = conductor
    workers = {node_id: peer("prefill", f"{node_id}-1") for node_id in ("d0", "d1", "d2")}
    for node_id, w in workers.items():
        assert code(await w.register("decode", node_id)) == "registered"
    front = peer("frontend", "a-1", "a")
    assert code(await front.register("frontend", "fa")) == "registered"
    await workers["d1"].sock.send_multipart(P.encode(P.Leave("d1")))  # draining
    await asyncio.sleep(0.3)
    c.cluster.get("d2").stalled = True  # its engine stopped progressing: it gets no new work, yet holds attempts
    c.cluster.reindex()
    assert not c.cluster.get("d1").takes_work and not c.cluster.get("d2").takes_work
    c.on_node_lost(c.cluster.get("fa"), "frontend fa died")
    for node_id, w in workers.items():
        gone = await w.recv(P.FrontendGone)
        assert (gone.node_id, gone.instance) == ("fa", "a-1"), node_id


async def test_workers_take_orders_from_frontend_keys_only_and_stream_to_the_key_that_ordered(keys):
    ctx, front_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()  # two processes: a ZAP handler each
    worker = Curve(keys, "decode")
    handled: list[P.Msg] = []

    async def handle(msg: P.Msg, tensors: list) -> None:
        handled.append(msg)

    orders = Orders(ctx, "127.0.0.1", worker, MAX_BYTES, "d0", handle)
    serving = asyncio.create_task(orders.serve(lambda: [m.req_id for m in handled]))
    a, b = Curve(keys, "frontend", "a"), Curve(keys, "frontend", "b")
    inlet, tokens_at = bind_server(front_ctx, zmq.ROUTER, a, "127.0.0.1", 0, MAX_BYTES)  # frontend a's token socket
    outlets = TokenOutlets(ctx, "d0", worker)
    socks = []
    try:
        for name, curve in (("conductor", Curve(keys, "conductor")), ("store", Curve(keys, "store")), ("a", a)):
            sock = connect_client(front_ctx, zmq.DEALER, curve, "worker", orders.endpoint, f"orderer-{name}")
            socks.append(sock)
            msg = P.DecodeRequest(f"{name}#1", [1, 2, 3], [], b"r" * 32, P.Sampling(), reply_to=tokens_at)
            await sock.send_multipart(P.encode(msg))
        deadline = time.monotonic() + 10
        while not handled and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert [m.req_id for m in handled] == ["a#1"]  # the conductor's and a store's orders dropped
        assert worker.vouched[tokens_at] == a.public
        await outlets.send(tokens_at, [P.TokenEvent("a#1", 0, [42])])
        frames = await asyncio.wait_for(inlet.recv_multipart(), 5)
        assert frames[0] == b"d0" and P.decode(frames[1:])[0].tokens == [42]
        worker.vouch(tokens_at, f"frontend:{b.public.decode()}")  # b claims a's socket: the handshake fails
        await outlets.send(tokens_at, [P.TokenEvent("a#1", 1, [43])])
        assert not await inlet.poll(500)
    finally:
        serving.cancel()
        for sock in socks:
            sock.close(0)
        outlets.close()
        orders.close()
        inlet.close(0)
        for curve in (worker, a):
            curve.stop()
        ctx.term()
        front_ctx.term()
