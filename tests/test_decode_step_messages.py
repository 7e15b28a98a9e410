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
    slot = w.incoming[rid]
    await w.run_engine(w.engine.begin_decoding, slot.seq, 7)
    w.join(slot)


async def test_a_step_sends_its_batch_in_one_message_and_retires_a_finished_request_after(decode_worker):
    w = decode_worker
    w.send = Recorder()
    await decoding(w, "a#1", max_tokens=2)  # its next token is its last
    await decoding(w, "b#1", max_tokens=8)
    retired = []
    real_retire = w._retire

    async def retire(slot, write):
        retired.append((slot.msg.req_id, len(w.send.sent)))
        await real_retire(slot, write)

    w._retire = retire
    sent_before = len(w.send.sent)
    assert await w._step()
    step, = w.send.sent[sent_before:]
    assert isinstance(step, P.TokenStep)
    assert [(e.req_id, e.index, len(e.tokens), e.finished) for e in step.events] == \
        [("a#1", 1, 1, P.FinishReason.LENGTH), ("b#1", 1, 1, None)]
    assert retired == [("a#1", sent_before + 1)]  # retired once its last token was sent
    assert list(w.running) == ["b#1"]

    assert await w._step()  # one sequence left: a plain TokenEvent
    event = w.send.sent[-1]
    assert isinstance(event, P.TokenEvent) and (event.req_id, event.index) == ("b#1", 2)
    await w._drop("b#1")
    await w._step()
    assert not w.running and w.engine.blocks.num_available() == w.engine.blocks.num_blocks


async def test_a_finished_request_whose_last_token_was_not_sent_stays_in_the_batch(decode_worker):
    w = decode_worker
    w.send = Recorder()
    await decoding(w, "a#1", max_tokens=2)

    async def lost(msg) -> None:
        raise ConnectionError("the conductor's link is gone")

    w.send = lost
    with pytest.raises(ConnectionError):
        await w._step()
    assert list(w.running) == ["a#1"]  # not retired unreported: the step loop's failure gives it up
