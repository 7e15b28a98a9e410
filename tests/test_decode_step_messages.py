"""What one decode step sends the conductor: every sequence's token in one ``TokenStep`` (one
message, however large the batch), a request's last token before its retirement."""

from __future__ import annotations

import pytest

from mooncake import protocol as P

from decode_workers import Recorder, small_decode_worker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def decode_worker():
    yield from small_decode_worker()


async def decoding(w, rid: str, max_tokens: int) -> None:
    """``rid`` reserved and in the batch, its first token given (its KV left as reserved: the
    tokens it decodes do not matter here)."""
    await w.handle(P.DecodeRequest(rid, list(range(40, 60)), [], b"root", P.Sampling(max_tokens=max_tokens)), [])
    slot = w.batch.incoming[rid]
    await w.host.run_engine(w.host.engine.begin_decoding, slot.seq, 7)
    w.batch.join(slot)


async def test_a_step_sends_its_batch_in_one_message_and_retires_a_finished_request_after(decode_worker):
    w = decode_worker
    w.host.send = Recorder()
    await decoding(w, "a#1", max_tokens=2)  # its next token is its last
    await decoding(w, "b#1", max_tokens=8)
    retired = []
    real_retire = w.batch._retire

    async def retire(slot, write):
        retired.append((slot.msg.req_id, len(w.host.send.sent)))
        await real_retire(slot, write)

    w.batch._retire = retire
    sent_before = len(w.host.send.sent)
    assert await w.batch.decode_step()
    step, = w.host.send.sent[sent_before:]
    assert isinstance(step, P.TokenStep)
    assert [(e.req_id, e.index, len(e.tokens), e.finished) for e in step.events] == \
        [("a#1", 1, 1, P.FinishReason.LENGTH), ("b#1", 1, 1, None)]
    assert retired == [("a#1", sent_before + 1)]  # retired once its last token was sent
    assert list(w.batch.running) == ["b#1"]

    assert await w.batch.decode_step()  # one sequence left: a plain TokenEvent
    event = w.host.send.sent[-1]
    assert isinstance(event, P.TokenEvent) and (event.req_id, event.index) == ("b#1", 2)
    await w.batch.drop("b#1")
    await w.batch.decode_step()
    assert not w.batch.running and w.host.engine.blocks.num_available() == w.host.engine.blocks.num_blocks


async def test_a_finished_request_whose_last_token_was_not_sent_stays_in_the_batch(decode_worker):
    w = decode_worker
    w.host.send = Recorder()
    await decoding(w, "a#1", max_tokens=2)

    async def lost(msg) -> None:
        raise ConnectionError("the conductor's link is gone")

    w.host.send = lost
    with pytest.raises(ConnectionError):
        await w.batch.decode_step()
    assert list(w.batch.running) == ["a#1"]  # not retired unreported: the step loop's failure gives it up
