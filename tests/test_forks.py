"""Choices of one prompt wait for the first one's prefill; cancelling one spares the others."""

from __future__ import annotations

from mooncake import protocol as P
from mooncake.frontend.forks import Forks
from mooncake.frontend.request import Finished, Request


def test_choices_wait_for_the_leaders_prefill_and_can_be_cancelled():
    started: list[str] = []
    forks = Forks(lambda r: started.append(r.req_id))
    leader = Request("req-1", [1, 2, 3], [], b"", P.Sampling(), 0.0)
    a, b = forks.fork(leader, P.Sampling(seed=1)), forks.fork(leader, P.Sampling(seed=2))
    assert (a.req_id, b.req_id) == ("req-1.1", "req-1.2") and started == [] and a.tokens == leader.tokens
    assert forks.cancel(b.req_id) and not forks.cancel(b.req_id)
    assert b.done and b.events.get_nowait() == Finished(P.FinishReason.ABORT)
    forks.release(leader)
    assert started == ["req-1.1"] and not forks.waiting and leader.followers == []
    leader.first_token_at = 1.0  # a choice forked after the prefill starts at once
    forks.fork(leader, P.Sampling())
    assert started == ["req-1.1", "req-1.3"]
    late = forks.fork(Request("req-2", [1], [], b"", P.Sampling(), 0.0), P.Sampling())
    forks.close("shutting down")
    assert late.done and late.events.get_nowait().error.message == "shutting down"
