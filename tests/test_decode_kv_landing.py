"""KV messages of different requests land on decode concurrently, through the real KV socket:
a request whose KV is slow to check does not hold up another's, and one request's messages
still land in the order they came."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from mooncake import protocol as P
from mooncake.kv.integrity import checksums
from mooncake.kv.link import connect_kv_egress
from mooncake.sockets import send_multipart

from decode_workers import Recorder, small_decode_worker, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def decode_worker():
    yield from small_decode_worker()


async def test_a_request_held_at_its_check_does_not_hold_up_another(decode_worker, monkeypatch):
    import mooncake.kv.ingress as decode_kv

    w = decode_worker
    w.host.send = Recorder()
    eng = w.host.engine
    T, token = eng.block_tokens, b"k" * 16
    kv = {"r1": torch.full((2, *eng.block_shape), 1.0, dtype=eng.dtype),
          "r2": torch.full((2, *eng.block_shape), 2.0, dtype=eng.dtype)}
    release, held = threading.Event(), threading.Event()
    real_check = decode_kv.first_corrupt

    def check(tensors, sums):  # r1's first message waits here (a worker thread) until released
        if float(tensors[0].flatten()[0]) == 1.0 and not release.is_set():
            held.set()
            release.wait(60)
        return real_check(tensors, sums)

    monkeypatch.setattr(decode_kv, "first_corrupt", check)
    for rid, first in (("r1", 100), ("r2", 500)):
        tokens = list(range(first, first + 2 * T))
        await w.handle(P.DecodeRequest(rid, tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
        await w.handle(P.FirstToken(rid, 7), [])
    endpoint = w.kv.bind(w.host.ctx, "127.0.0.1", 0, w.host.max_message_bytes)
    out = connect_kv_egress(w.host.ctx, None, endpoint)
    loop = asyncio.create_task(w.kv.receive_loop())
    try:
        def block(rid: str, first: int) -> list:
            return P.encode(P.KVTransfer(rid, first, token=token, checksums=checksums(kv[rid][first:first + 1])),
                            [kv[rid][first]])

        for frames in (block("r1", 0), block("r1", 1), block("r2", 0), block("r2", 1)):
            await send_multipart(out, frames)
        await until(lambda: "r2" in w.batch.running)  # r2 landed whole and started while r1 is held
        assert held.is_set() and w.batch.incoming["r1"].next_block == 0  # r1's second block waits behind its first
        release.set()
        await until(lambda: "r1" in w.batch.running)
        assert not [m for m in w.host.send.sent if isinstance(m, P.Failed)]  # r1's blocks landed in order
        for rid in ("r1", "r2"):
            assert torch.equal(eng.kv.export_sequence(w.batch.running[rid].seq, 0, 2), kv[rid])
    finally:
        release.set()
        loop.cancel()
        out.close(0)
        await w.close()
