"""The prefill -> decode KV link under CURVE: every fresh connection's first transfer arrives.

History: with CURVE on this link the first KV transfer intermittently never arrived. The
cause: a CURVE server socket reports itself readable while a peer's handshake completes
and the receive then fails with EAGAIN; pyzmq's asyncio socket raised it as ``zmq.Again``
out of ``await recv_multipart()``, which ended decode's ingress loop for good. The link
now receives through ``mooncake.sockets.recv_multipart``, which retries.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.kv.integrity import checksums, first_corrupt
from mooncake.kv.link import bind_kv_ingress, connect_kv_egress
from mooncake.security import Curve, generate_keys, kind_of, peer_of
from mooncake.sockets import recv_multipart, send_multipart

pytestmark = pytest.mark.timeout(120)
BLOCK = (2, 2, 1, 16, 8)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    generate_keys(d)
    return d


async def test_fifty_fresh_curve_connections_each_deliver_their_first_transfer(keys):
    ingress_ctx, egress_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    decode, prefill = Curve(keys, "decode"), Curve(keys, "prefill")
    pull, endpoint = bind_kv_ingress(ingress_ctx, decode, "127.0.0.1", 0, 16 << 20)
    try:
        for i in range(50):
            push = connect_kv_egress(egress_ctx, prefill, endpoint)
            kv = torch.randn(3, *BLOCK)
            msg = P.KVTransfer(f"req-{i}", 0, token=b"t" * 16, checksums=checksums(kv))
            await asyncio.wait_for(send_multipart(push, P.encode(msg, list(kv.unbind(0)))), 10)
            frames = await asyncio.wait_for(recv_multipart(pull), 10)
            got, tensors = P.decode(frames, block_shape=BLOCK)
            assert got.req_id == f"req-{i}" and first_corrupt(tensors, got.checksums) is None
            assert torch.equal(torch.stack(tensors), kv)
            assert kind_of(peer_of(frames[0])) == "worker"  # the ZAP handler tagged the sender's key kind
            push.close(0)
    finally:
        decode.stop()
        pull.close(0)
        ingress_ctx.term()
        egress_ctx.term()


async def test_a_key_outside_the_cluster_delivers_nothing(keys, tmp_path):
    generate_keys(tmp_path / "other")
    ctx = zmq.asyncio.Context()
    decode = Curve(keys, "decode")
    pull, endpoint = bind_kv_ingress(ctx, decode, "127.0.0.1", 0, 16 << 20)
    push = connect_kv_egress(ctx, Curve(tmp_path / "other", "prefill"), endpoint)
    try:
        send = asyncio.ensure_future(send_multipart(push, P.encode(P.KVTransfer("forged", 0))))
        assert await pull.poll(1000) == 0  # the handshake fails: the message never leaves
        assert not send.done()
        send.cancel()
    finally:
        decode.stop()
        push.close(0)
        pull.close(0)
        ctx.term()
