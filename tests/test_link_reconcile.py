"""A worker's link reconciles on every registration: it says what it holds, and drops what the
conductor answers it no longer knows there (a conductor that restarted, or that had declared the
worker dead). Against a real ZeroMQ ROUTER standing in for the conductor."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.roles.conductor_link import ConductorLink
from mooncake.sockets import recv_multipart, send_multipart


async def test_registration_reports_what_is_held_and_drops_what_the_conductor_does_not_keep(tmp_path):
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/conductor"
    router.bind(endpoint)
    held = ["a#1", "b#1"]
    dropped: list[list[str]] = []

    async def drop(ids: list[str]) -> None:
        dropped.append(ids)

    reg = P.Register("decode", "d0", P.NodeInfo("n0", 1))
    link = ConductorLink(ctx, endpoint, reg, holding=lambda: list(held), on_orphans=drop)

    async def conductor(keep: list[str]) -> P.Register:
        ident, *frames = await recv_multipart(router)
        msg, _ = P.decode(frames)
        assert isinstance(msg, P.Register)
        await send_multipart(router, [ident, *P.encode(P.Registered(msg.node_id, 0.5, keep))])
        return msg

    try:
        first, _ = await asyncio.gather(conductor(["a#1"]), link.connect(timeout_s=10))
        assert first.holding == ["a#1", "b#1"]
        await asyncio.sleep(0.05)
        assert dropped == [["b#1"]]

        held[:] = ["a#1", "c#2"]  # later: the conductor restarted and knows nothing
        receiving = asyncio.create_task(link.recv())
        await send_multipart(router, [P.routing_id(reg), *P.encode(P.Reregister())])
        again = await conductor([])
        assert again.holding == ["a#1", "c#2"]
        await asyncio.sleep(0.05)
        assert dropped == [["b#1"], ["a#1", "c#2"]]
        receiving.cancel()
    finally:
        link.close()
        router.close(0)
        ctx.term()


async def test_a_restarted_role_is_heard_while_its_old_connection_lingers(tmp_path):
    """A role restarted under the same node id (its old process's connection not yet gone, as
    after a kill on a host that did not reset it) registers: its routing id carries its start's
    instance, where one routing id for both made the ROUTER refuse the new connection."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/conductor"
    router.bind(endpoint)

    async def answer(n: int) -> list[bytes]:
        idents = []
        for _ in range(n):
            ident, *frames = await recv_multipart(router)
            msg, _ = P.decode(frames)
            if isinstance(msg, P.Register):
                idents.append(bytes(ident))
                await send_multipart(router, [ident, *P.encode(P.Registered(msg.node_id, 0.5, []))])
        return idents

    old = ConductorLink(ctx, endpoint, P.Register("store", "n0-store", P.NodeInfo("n0", 1, instance="first")))
    new = ConductorLink(ctx, endpoint, P.Register("store", "n0-store", P.NodeInfo("n0", 1, instance="second")))
    try:
        first, _ = await asyncio.gather(answer(1), old.connect(timeout_s=5))
        second, _ = await asyncio.gather(answer(1), new.connect(timeout_s=5))  # the old one still connected
        assert first == [b"n0-store@first"] and second == [b"n0-store@second"]
        assert P.node_of(second[0]) == "n0-store"
    finally:
        old.close()
        new.close()
        router.close(0)
        ctx.term()
