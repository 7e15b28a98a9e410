"""The P2P request/reply helper: an abandoned call's late reply never answers the next call."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from mooncake.protocol.p2p import Done, Locate, decoder, encoder
from mooncake.p2p.rpc import P2PError, Rpc

pytestmark = pytest.mark.timeout(30)


async def _serve(sock: zmq.asyncio.Socket, first_reply_after: asyncio.Event) -> None:
    """Answer each Locate with Done(its name); the first answer only once ``first_reply_after`` is set."""
    first = True
    while True:
        ident, body = await sock.recv_multipart()
        msg = decoder.decode(body)
        if first:
            await first_reply_after.wait()
            first = False
        await sock.send_multipart([ident, encoder.encode(Done(msg.name))])


@pytest.mark.parametrize("abandon", ["cancelled", "timed out"])
async def test_a_late_reply_never_answers_the_next_call(abandon):
    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    release = asyncio.Event()
    serving = asyncio.create_task(_serve(server, release))
    rpc = Rpc(ctx, f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    try:
        if abandon == "cancelled":
            call = asyncio.create_task(rpc.call(Locate("first")))
            await asyncio.sleep(0.2)  # sent, waiting for its reply
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        else:
            with pytest.raises(P2PError, match="no answer"):
                await rpc.call(Locate("first"))
        release.set()  # the first reply goes out now, to the abandoned socket
        await asyncio.sleep(0.1)
        reply = await rpc.call(Locate("second"))
        assert reply == Done("second")
    finally:
        serving.cancel()
        rpc.close()
        server.close(0)
        ctx.term()
