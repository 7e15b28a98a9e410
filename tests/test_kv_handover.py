"""The hand-over of a request from prefill to decode takes as few engine calls as it can: on decode,
a request's KV messages that arrive while an earlier one lands go together in one engine call, and
the call that completes its KV also begins its decoding; on prefill, the KV leaves without waiting
for the engine thread (which may be computing other prompts' chunks). Each engine call waits for
the decode step in progress, so each one saved is a step off the first inter-token gap."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from mooncake import protocol as P
from mooncake.kv.integrity import checksums
from mooncake.kv.link import connect_kv_egress
from mooncake.kv.prefill_kv import export_in_thread
from mooncake.sockets import send_multipart

from decode_workers import Recorder, small_decode_worker, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def decode_worker():
    yield from small_decode_worker()


def counting_engine_calls(w) -> list:
    """Record the function of every engine call the worker makes from now on."""
    calls: list = []
    real = w.batch.run_engine

    async def run_engine(fn, *args):
        calls.append(fn)
        return await real(fn, *args)

    w.batch.run_engine = run_engine  # the KV ingress calls the engine through the batch
    return calls


async def test_layer_messages_queued_behind_a_write_land_in_one_call_that_also_begins_decoding(decode_worker):
    w = decode_worker
    w.host.send = Recorder()
    eng = w.host.engine
    L, T, token = eng.block_shape[0], eng.block_tokens, b"k" * 16
    tokens = list(range(100, 100 + 3 * T))
    kv = torch.randn(3, *eng.block_shape).to(eng.dtype)
    await w.handle(P.DecodeRequest("r", tokens, [], b"root", P.Sampling(max_tokens=4), kv_token=token), [])
    await w.handle(P.FirstToken("r", 7), [])
    slot = w.batch.incoming["r"]
    calls = counting_engine_calls(w)
    hold = threading.Event()
    w.host.pool.submit(hold.wait, 60)  # the engine thread is busy (a decode step, say) while the KV comes in
    endpoint = w.kv.bind(w.host.ctx, "127.0.0.1", 0, w.host.max_message_bytes)
    out = connect_kv_egress(w.host.ctx, None, endpoint)
    loop = asyncio.create_task(w.kv.receive_loop())
    try:
        for layer in range(L):  # a layer-wise prefill: one message per layer
            part = kv[:, layer].contiguous()
            await send_multipart(out, P.encode(P.KVLayer("r", 0, layer, token=token, checksums=checksums([part])),
                                               [part]))
        await until(lambda: len(slot.inbox) == L - 1)  # the first waits for the engine, the rest queue behind it
        hold.set()
        await until(lambda: "r" in w.batch.running)
        assert len(calls) == 2  # the first layer's write, then the other layers' writes with begin_decoding
        assert eng.begin_decoding not in calls  # no call of its own
        assert slot.seq.prefilled and slot.seq.tokens[-1] == 7
        assert torch.equal(eng.kv.export_sequence(slot.seq, 0, 3), kv)
        assert not [m for m in w.host.send.sent if isinstance(m, P.Failed)]
    finally:
        hold.set()
        loop.cancel()
        out.close(0)
        await w.close()


TOKEN = b"k" * 16


async def reserved(w, blocks: int) -> torch.Tensor:
    """Request "r" of ``blocks`` full blocks reserved on ``w`` (sends recorded); KV for them."""
    w.host.send = Recorder()
    eng = w.host.engine
    await w.handle(P.DecodeRequest("r", list(range(blocks * eng.block_tokens)), [], b"root",
                                   P.Sampling(max_tokens=4), kv_token=TOKEN), [])
    return torch.randn(blocks, *eng.block_shape).to(eng.dtype)


async def test_the_first_token_after_the_kv_still_begins_decoding(decode_worker):
    w = decode_worker
    kv = await reserved(w, 2)
    token = TOKEN
    slot = w.batch.incoming["r"]
    await w.kv.land_kv(slot, [(P.KVTransfer("r", 0, token=token, checksums=checksums(list(kv))), list(kv))])
    assert slot.kv_complete and not slot.started and "r" in w.batch.incoming  # all KV in, no first token yet
    await w.handle(P.FirstToken("r", 9), [])
    assert "r" in w.batch.running and slot.seq.tokens[-1] == 9


async def test_a_message_out_of_order_in_a_batch_fails_the_request_and_writes_nothing(decode_worker):
    w = decode_worker
    eng = w.host.engine
    kv = await reserved(w, 3)
    token = TOKEN
    await w.handle(P.FirstToken("r", 9), [])
    slot = w.batch.incoming["r"]
    calls = counting_engine_calls(w)
    batch = [(P.KVTransfer("r", first, token=token, checksums=checksums([kv[first]])), [kv[first]]) for first in (0, 2)]
    await w.kv.land_kv(slot, batch)  # block 2 does not continue block 0
    assert "r" not in w.batch.incoming and "r" not in w.batch.running
    assert [m.message for m in w.host.send.sent if isinstance(m, P.Failed)] == ["KV arrived out of order or oversized"]
    assert calls == [eng.free]  # nothing was written


async def test_prefill_exports_kv_while_its_engine_thread_is_busy():
    from mooncake.config import Config, MiB
    from mooncake.roles.prefill import PrefillWorker

    cfg = Config()
    cfg.model.device, cfg.engine.kv_cache_bytes, cfg.engine.threads = "cpu", 16 * MiB, 1
    cfg.engine.profile_at_start = False
    w = PrefillWorker(cfg)
    hold = threading.Event()
    try:
        eng = w.host.engine
        ids = list(range(100, 100 + 2 * eng.block_tokens + 5))
        seq = eng.add_sequence("r", ids, P.Sampling(max_tokens=4))
        while not eng.prefill(seq).done:
            pass
        w.host.pool.submit(hold.wait, 60)  # the engine thread computes another prompt's chunk
        kv = await asyncio.wait_for(export_in_thread(eng, seq, 1, None), 30)
        assert not hold.is_set()
        assert torch.equal(kv, eng.kv.export_sequence(seq, 1, None)) and len(kv) == 2  # block 1 and the partial tail
    finally:
        hold.set()
        w.host.pool.shutdown(wait=False)
        w.host.ctx.term()
