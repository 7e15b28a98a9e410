"""How many chunk requests a fetch keeps in flight to a holder: the base on a slow link (an
egress cap), twice that once the holder delivers fast. Timestamps are given, not measured."""

from __future__ import annotations

from mooncake.p2p.holders import FAST_HOLDER_BYTES_PER_S, Peer, in_flight_for

CHUNK = 16 << 20


def holder() -> Peer:
    return Peer("id", "host1", "tcp://10.0.0.1:1", sock=None, monitor=None, last_reply=100.0)  # type: ignore[arg-type]


def test_a_holder_gets_the_base_depth_until_it_has_delivered():
    assert in_flight_for(holder(), 2) == 2


def test_a_fast_holder_gets_twice_the_base_and_a_slow_one_the_base():
    fast, slow = holder(), holder()
    fast.delivered(CHUNK, sent_at=100.0, now=100.02)  # 16 MiB in 20 ms: ~840 MB/s
    slow.delivered(CHUNK, sent_at=100.0, now=100.7)  # 200 Mbit/s: ~24 MB/s
    assert fast.rate > FAST_HOLDER_BYTES_PER_S > slow.rate
    assert in_flight_for(fast, 2) == 4 and in_flight_for(slow, 2) == 2


def test_a_queued_request_counts_from_the_previous_reply_not_from_when_it_was_sent():
    """Four requests sent at once to a 24 MB/s link: the fourth reply arrives 2.8 s after it was
    asked, but its link was busy with it for the last 0.7 s only (the rate stays ~24 MB/s)."""
    p = holder()
    for k in range(1, 5):
        p.delivered(CHUNK, sent_at=100.0, now=100.0 + 0.7 * k)
    assert abs(p.rate - CHUNK / 0.7) < 1e3
    assert p.last_reply == 100.0 + 2.8


def test_the_depth_follows_the_link_when_it_slows_down():
    p = holder()
    p.delivered(CHUNK, sent_at=100.0, now=100.02)
    assert in_flight_for(p, 2) == 4
    for k in range(1, 6):  # then capped: 0.7 s per chunk; within a few chunks, back to the base
        p.delivered(CHUNK, sent_at=100.0, now=100.02 + 0.7 * k)
    assert in_flight_for(p, 2) == 2
