"""A decode instance under request classes: an interactive request waiting for room takes it
from flex work (preempted, to resume later), never the other way round; flex work yields the
machine's cores while an interactive request's prefill runs beside it."""

from __future__ import annotations

import pytest

from mooncake import protocol as P

from decode_workers import Recorder, small_decode_worker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def decode_worker():
    yield from small_decode_worker()


def request(rid: str, blocks: int, cls_name: str, block_tokens: int, beside: bool = False) -> P.DecodeRequest:
    tokens = list(range(100, 100 + blocks * block_tokens))
    return P.DecodeRequest(rid, tokens, [], b"root", P.Sampling(max_tokens=4, request_class=cls_name), kv_token=b"k" * 16,
                           prefill_beside=beside)


async def test_an_interactive_reservation_preempts_flex_work_and_flex_waits(decode_worker):
    w = decode_worker
    w.host.send = Recorder()
    T, pool = w.host.engine.block_tokens, w.host.engine.num_blocks
    big = pool * 2 // 3
    await w.handle(request("flex", big, "flex", T), [])
    assert "flex" in w.batch.incoming
    await w.handle(request("chat", big, "default", T), [])  # does not fit beside it
    assert "chat" in w.batch.incoming and "flex" not in w.batch.incoming
    preempted = [m for m in w.host.send.sent if isinstance(m, P.Failed)]
    assert [(m.req_id, m.kind) for m in preempted] == [("flex", P.FailureKind.PREEMPTED)]
    # the flex request's next attempt waits for room; another interactive one never yields to it
    await w.handle(request("flex#1", big, "flex", T), [])
    assert [m.req_id for m in w.batch.pending] == ["flex#1"] and "chat" in w.batch.incoming
    assert [m.req_id for m in w.host.send.sent if isinstance(m, P.Reserved)] == ["flex", "chat"]
    await w.close()


async def test_flex_work_yields_the_cores_while_an_interactive_prefill_runs_beside_it(decode_worker):
    w = decode_worker
    w.host.send = Recorder()
    T = w.host.engine.block_tokens
    await w.handle(request("flex", 2, "flex", T), [])
    slot = w.batch.incoming["flex"]
    slot.layers_in = [len(slot.seq.block_table)] * len(slot.layers_in)  # its KV has landed (by hand)
    await w.handle(P.FirstToken("flex", 7), [])
    assert "flex" in w.batch.running
    await w.handle(request("elsewhere", 1, "default", T), [])  # its prefill runs on another machine
    assert await w.batch.decode_step() and [m.req_id for m in w.host.send.sent if isinstance(m, P.TokenEvent)] == ["flex"]
    await w.handle(request("chat", 1, "default", T, beside=True), [])  # its prefill shares our cores
    assert not await w.batch.decode_step()  # nothing else runs: the flex sequence waits
    w.batch.wake.clear()  # as the step loop does before it waits
    await w.handle(P.Abort("chat"), [])  # the reservation ends (here: dropped): flex work goes on
    assert w.batch.wake.is_set() and await w.batch.decode_step()
    assert [m.req_id for m in w.host.send.sent if isinstance(m, P.TokenEvent)] == ["flex", "flex"]
    await w.close()
