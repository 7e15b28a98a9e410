"""What a role's link sends the conductor, and when: heartbeats on the wall clock's ticks, the
blocks it cached carried by them (early, on the next report tick), and no heartbeat while
messages that stand in for one go (a frontend's ``Submit``). Against a real ZeroMQ ROUTER
standing in for the conductor."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.conductor.router import Router
from mooncake.roles.block_events import BlockEvents
from mooncake.roles.conductor_link import ConductorLink
from mooncake.sched.node_registry import Cluster
from mooncake.sockets import recv_multipart, send_multipart
from mooncake.ticks import REPORT_EVERY_S, SLACK_S, last_tick, until_tick

HEARTBEAT_S = 1.0


def test_a_tick_is_the_first_multiple_of_the_period_far_enough_ahead() -> None:
    assert until_tick(1.0, now=10.25) == pytest.approx(0.75)
    assert until_tick(1.0, now=10.0) == pytest.approx(0.0)
    assert until_tick(1.0, 0.5, now=10.75) == pytest.approx(1.25)  # 11.0 is only 0.25 away
    assert until_tick(0.1, now=3.01) == pytest.approx(0.09)
    assert until_tick(0.5, -3.0, now=2.2) == pytest.approx(0.3)  # a past bound is now
    assert last_tick(0.5, 11.7) == pytest.approx(11.5) and last_tick(0.5, 12.0) == pytest.approx(12.0)


@pytest.fixture
async def conductor(tmp_path):
    """A ROUTER that registers one link and records what it sends after, with when it came."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/conductor"
    router.bind(endpoint)
    heard: list[tuple[float, P.Msg]] = []
    links: list[ConductorLink] = []

    async def serve() -> None:
        while True:
            ident, *frames = await recv_multipart(router)
            msg, _ = P.decode(frames)
            if isinstance(msg, P.Register):
                await send_multipart(router, [ident, *P.encode(P.Registered(msg.node_id, HEARTBEAT_S))])
            else:
                heard.append((time.time(), msg))

    async def connect(role: str, blocks: BlockEvents | None = None) -> ConductorLink:
        link = ConductorLink(ctx, endpoint, P.Register(role, f"{role}0", P.NodeInfo("n0", 1)), P.Load)
        links.append(link)
        await link.connect(timeout_s=10)
        link.start_heartbeat(blocks)
        return link

    server = asyncio.create_task(serve())
    try:
        yield connect, heard
    finally:
        server.cancel()
        for link in links:
            link.close()
        router.close(0)
        ctx.term()


def heartbeats(heard: list[tuple[float, P.Msg]]) -> list[tuple[float, P.Heartbeat]]:
    return [(t, m) for t, m in heard if isinstance(m, P.Heartbeat)]


async def test_heartbeats_go_on_the_ticks_every_node_shares(conductor):
    connect, heard = conductor
    await connect("decode")
    await asyncio.sleep(3.5 * HEARTBEAT_S)
    beats = heartbeats(heard)
    assert len(beats) >= 2
    tick = HEARTBEAT_S / 2
    offsets = sorted(min(t % tick, tick - t % tick) for t, _ in beats)
    assert offsets[len(offsets) // 2] < 0.1 * tick, offsets  # on ticks (allowing for this machine's load)
    assert all(msg.blocks == [] for _, msg in beats)
    gaps = [b[0] - a[0] for a, b in zip(beats, beats[1:])]
    assert all(g >= tick - SLACK_S for g in gaps), gaps  # never two within half an interval
    assert sorted(gaps)[len(gaps) // 2] < HEARTBEAT_S + 0.1, gaps  # and one at least every interval


async def test_blocks_go_with_the_next_report_tick_not_the_next_heartbeat(conductor):
    connect, heard = conductor
    blocks = BlockEvents("prefill0")
    await connect("prefill", blocks)
    await asyncio.sleep(until_tick(HEARTBEAT_S) + 0.02)  # just after a heartbeat
    added_at = time.time()
    blocks.add("stored", "device", [b"a", b"b"])
    blocks.add("removed", "device", [b"a"])  # only a block's last event counts
    blocks.add("stored", "dram", [b"c"])
    for _ in range(100):
        after = [(t, m) for t, m in heartbeats(heard) if t > added_at]
        if after:
            break
        await asyncio.sleep(REPORT_EVERY_S / 2)
    t, report = after[0]
    assert t - added_at < HEARTBEAT_S / 2, t - added_at  # on a report tick: the heartbeat was due later
    assert [(e.kind, e.tier, e.hashes) for e in report.blocks] == [
        ("removed", "device", [b"a"]), ("stored", "device", [b"b"]), ("stored", "dram", [b"c"])]
    assert not blocks.pending.is_set() and blocks.take() == []


async def test_a_busy_frontend_sends_no_heartbeat_its_submits_stand_in(conductor):
    connect, heard = conductor
    link = await connect("frontend")
    busy_until = time.time() + 2.5 * HEARTBEAT_S
    while time.time() < busy_until:
        await link.send(P.ClusterQuery("frontend0"), beat=True)  # a Submit's stand-in: any beat
        await asyncio.sleep(HEARTBEAT_S / 10)
    assert heartbeats(heard) == []
    await asyncio.sleep(2.5 * HEARTBEAT_S)  # idle again: heartbeats again
    assert heartbeats(heard)


async def test_a_submit_from_a_frontend_the_conductor_does_not_know_is_answered_register_again(tmp_path):
    """A busy frontend sends no heartbeat, so a conductor that restarted (or declared it dead)
    answers its Submit with Reregister, as it answers a heartbeat: once a second per sender."""
    router = Router(f"ipc://{tmp_path}/conductor", Cluster(), None, lambda ident, msg, peer: P.Error("no", "x"))
    serving = asyncio.create_task(router.serve())
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(router.endpoint)
    submit = P.Submit("r#1", "frontend0", [], [b"h" * 32], b"", P.Sampling(), n_tokens=20, new_request=True)
    try:
        for _ in range(3):  # within a second: one answer
            await send_multipart(sock, P.encode(submit))
        reply, _ = P.decode(await asyncio.wait_for(recv_multipart(sock), 5))
        assert isinstance(reply, P.Reregister)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(recv_multipart(sock), 0.3)
    finally:
        serving.cancel()
        sock.close(0)
        ctx.term()
        router.close()
