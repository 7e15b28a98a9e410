"""The conductor's request life without workers: admission, booking, the attempt protocol,
ordering by index, failure kinds, moving requests off lost nodes."""

from __future__ import annotations

import pytest

from mooncake import protocol as P
from mooncake.conductor import Conductor, Finished, Rejection, Tokens
from mooncake.conductor.request import Request, RequestStatus, TransitionError
from mooncake.config import Config
from mooncake.sched.cluster import Node

FACTS = P.ModelFacts("m@x/float32", 16, 128, 1000, (2, 2, 1, 16, 8))


class Sent:
    """Stands in for the conductor's socket: records what it would send to whom."""

    def __init__(self) -> None:
        self.log: list[tuple[str, P.Msg]] = []

    def send(self, node_id: str, msg: P.Msg) -> None:
        self.log.append((node_id, msg))

    def of(self, kind: type) -> list[tuple[str, P.Msg]]:
        return [(n, m) for n, m in self.log if isinstance(m, kind)]

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def register(c: Conductor, node_id: str, role: str, **endpoints: str) -> Node:
    info = P.NodeInfo("n0", 1, FACTS if role != "store" else None, num_blocks=64)
    reply = c.membership.register(node_id.encode(), P.Register(role, node_id, info, endpoints), 0.0)
    assert isinstance(reply, P.Registered)
    return c.cluster.get(node_id)


@pytest.fixture
async def conductor():
    cfg = Config()
    cfg.conductor.max_requests = 2
    c = Conductor(cfg, tokenizer=None, model_name="m")
    c.router = Sent()
    register(c, "p0", "prefill")
    register(c, "d0", "decode", kv="tcp://127.0.0.1:1")
    yield c
    await c.close()


def events(req: Request) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def run_to_decoding(c: Conductor, req: Request, first: int = 7) -> None:
    p0, d0 = c.cluster.get("p0"), c.cluster.get("d0")
    c._on_reserved(d0, P.Reserved(req.wire_id, "d0"))
    c._on_prefill_done(p0, P.PrefillDone(req.wire_id, "p0", first, 0, len(req.all_tokens), 0.01))


async def test_an_attempt_reserves_on_decode_before_prefill_starts(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=4))
    assert isinstance(req, Request) and req.status is RequestStatus.RESERVING
    assert [n for n, _ in conductor.router.of(P.DecodeRequest)] == ["d0"] and not conductor.router.of(P.PrefillRequest)
    conductor._on_reserved(conductor.cluster.get("d0"), P.Reserved(req.wire_id, "d0"))
    (node, msg), = conductor.router.of(P.PrefillRequest)
    assert node == "p0" and msg.decode_endpoint == "tcp://127.0.0.1:1" and msg.root == req.root
    conductor._on_prefill_done(conductor.cluster.get("p0"), P.PrefillDone(req.wire_id, "p0", 7, 0, 3, 0.01))
    assert conductor.router.of(P.FirstToken) == [("d0", P.FirstToken(req.wire_id, 7))]
    conductor._on_tokens(conductor.cluster.get("d0"), P.TokenEvent(req.wire_id, 1, [8, 9]))
    conductor._on_tokens(conductor.cluster.get("d0"), P.TokenEvent(req.wire_id, 3, [10], P.FinishReason.LENGTH))
    assert req.generated == [7, 8, 9, 10] and req.done
    assert events(req)[-1] == Finished(P.FinishReason.LENGTH)
    assert conductor.scheduler.assigned("d0") == 0 and req.req_id not in conductor.requests


async def test_requests_in_flight_are_bounded_and_cancel_releases_the_booking(conductor):
    a = conductor.submit([1, 2, 3], P.Sampling(max_tokens=4))
    conductor.submit([4, 5, 6], P.Sampling(max_tokens=4))
    r = conductor.submit([7, 8, 9], P.Sampling(max_tokens=4))
    assert isinstance(r, Rejection) and r.status == 503 and r.reason == "overloaded" and r.retry_after_s
    assert conductor.scheduler.assigned("d0") == 2 and conductor.scheduler.queued("p0") == 2
    conductor.cancel(a.req_id)
    assert conductor.scheduler.assigned("d0") == 1 and a.wire_id not in conductor.attempts
    assert {n for n, m in conductor.router.of(P.Abort) if m.req_id == a.wire_id} == {"p0", "d0"}
    assert isinstance(conductor.submit([7, 8, 9], P.Sampling(max_tokens=4)), Request)


async def test_prompt_checks_and_max_tokens_clamp(conductor):
    r = conductor.submit(list(range(128)), P.Sampling(max_tokens=4))
    assert isinstance(r, Rejection) and r.reason == "context_length_exceeded" and r.param == "prompt"
    r = conductor.submit([5000], P.Sampling(max_tokens=4))
    assert isinstance(r, Rejection) and r.status == 400 and r.param == "prompt"
    req = conductor.submit(list(range(100)), P.Sampling(max_tokens=500))
    assert req.sampling.max_tokens == 28


async def test_no_workers_is_503_and_a_prompt_larger_than_every_pool_is_400():
    c = Conductor(Config(), tokenizer=None, model_name="m")
    c.router = Sent()
    r = c.submit([1], P.Sampling())
    assert isinstance(r, Rejection) and r.status == 503 and r.reason == "no_workers"
    register(c, "p0", "prefill")
    register(c, "d0", "decode", kv="tcp://x")
    c.cluster.get("d0").info = P.NodeInfo("n0", 1, FACTS, num_blocks=2)
    r = c.submit(list(range(40)), P.Sampling())
    assert isinstance(r, Rejection) and r.status == 400 and "KV blocks" in r.message
    await c.close()


async def test_block_events_feed_the_index_and_a_dead_node_leaves_it(conductor):
    p0 = conductor.cluster.get("p0")
    conductor._on_block_event(p0, P.BlockEvent("p0", "stored", "device", [b"a" * 32, b"b" * 32]))
    conductor._on_block_event(p0, P.BlockEvent("p0", "removed", "device", [b"a" * 32]))
    assert conductor.index.holders(b"b" * 32) == {"p0": "device"} and len(conductor.index) == 1
    conductor.membership.check(now=1e9)  # everyone silent since t=0
    assert len(conductor.index) == 0 and conductor.cluster.get("p0") is None


async def test_a_registering_worker_keeps_only_the_attempts_that_still_run_there(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    info = P.NodeInfo("n0", 1, FACTS, num_blocks=64)
    holding = [req.wire_id, "gone#1", "other-request#3"]  # one live attempt, two the conductor never knew
    reply = conductor.membership.register(b"d0", P.Register("decode", "d0", info, {"kv": "tcp://127.0.0.1:1"},
                                                            holding=holding), 1.0)
    assert reply.keep == [req.wire_id]
    reply = conductor.membership.register(b"p9", P.Register("prefill", "p9", info, holding=[req.wire_id]), 1.0)
    assert reply.keep == []  # the attempt runs, but not on p9
    assert conductor.metrics.reconciliation_aborts._value.get() == 3


async def test_messages_of_an_earlier_attempt_are_ignored(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    old = req.wire_id
    d0, p0 = conductor.cluster.get("d0"), conductor.cluster.get("p0")
    conductor._on_failed(d0, P.Failed(old, "d0", "decode lost it"))  # a second attempt
    assert req.wire_id != old and req.migrations == 1
    conductor._on_tokens(d0, P.TokenEvent(old, 0, [5, 6]))  # late tokens of attempt 1
    conductor._on_failed(p0, P.Failed(old, "p0", "late failure of attempt 1"))
    conductor._on_reserved(d0, P.Reserved(old, "d0"))
    assert req.generated == [] and req.migrations == 1 and req.status is RequestStatus.RESERVING
    run_to_decoding(conductor, req)
    conductor._on_tokens(d0, P.TokenEvent(req.wire_id, 1, [8]))
    assert req.generated == [7, 8] and conductor.scheduler.assigned("d0") == 1


async def test_tokens_are_emitted_in_index_order_and_duplicates_dropped(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    run_to_decoding(conductor, req)
    d0 = conductor.cluster.get("d0")
    conductor._on_tokens(d0, P.TokenEvent(req.wire_id, 3, [11]))  # overtook index 1-2: held
    assert req.generated == [7]
    conductor._on_tokens(d0, P.TokenEvent(req.wire_id, 1, [9, 10]))
    conductor._on_tokens(d0, P.TokenEvent(req.wire_id, 2, [10]))  # a duplicate
    assert req.generated == [7, 9, 10, 11]
    assert [e.ids for e in events(req) if isinstance(e, Tokens)] == [[7], [9, 10], [11]]


async def test_a_token_step_feeds_each_of_its_requests_and_one_bad_event_costs_the_others_nothing(conductor):
    conductor.cfg.conductor.max_requests = 3
    a, b, c = (conductor.submit([1, 2, n], P.Sampling(max_tokens=8)) for n in (3, 4, 5))
    for req in (a, b, c):
        run_to_decoding(conductor, req)
    d0 = conductor.cluster.get("d0")

    def broken(*args: object) -> int:
        raise RuntimeError("a bug in one request's handling")

    b.accept = broken
    conductor._on_token_step(d0, P.TokenStep([P.TokenEvent(a.wire_id, 1, [8]), P.TokenEvent("req-gone#1", 1, [9]),
                                              P.TokenEvent(b.wire_id, 1, [8]),
                                              P.TokenEvent(c.wire_id, 1, [9], P.FinishReason.STOP)]))
    assert a.generated == [7, 8] and not a.done
    assert c.generated == [7, 9] and c.done and events(c)[-1] == Finished(P.FinishReason.STOP)


async def test_fatal_failures_end_the_request_with_a_client_error(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    conductor._on_failed(conductor.cluster.get("d0"), P.Failed(req.wire_id, "d0", "bad temperature",
                                                                P.FailureKind.FATAL, "temperature"))
    assert req.done and req.migrations == 0
    end = events(req)[-1]
    assert end.reason is P.FinishReason.ERROR and end.error.status == 400 and end.error.param == "temperature"


async def test_retries_are_bounded_and_preemptions_do_not_count(conductor):
    conductor.cfg.conductor.max_migrations = 1
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    d0 = conductor.cluster.get("d0")
    for _ in range(3):
        conductor._on_failed(d0, P.Failed(req.wire_id, "d0", "pool full", P.FailureKind.PREEMPTED))
    assert req.attempts == 4 and req.migrations == 0 and not req.done
    conductor._on_failed(d0, P.Failed(req.wire_id, "d0", "boom"))
    assert req.migrations == 1 and not req.done
    conductor._on_failed(d0, P.Failed(req.wire_id, "d0", "boom again"))
    assert req.done and events(req)[-1].error.status == 503


async def test_a_moved_request_resumes_with_its_tokens_and_their_hashes(conductor):
    req = conductor.submit(list(range(20)), P.Sampling(max_tokens=30))
    run_to_decoding(conductor, req)
    conductor._on_tokens(conductor.cluster.get("d0"), P.TokenEvent(req.wire_id, 1, list(range(100, 112))))
    conductor.on_node_lost(conductor.cluster.get("d0"), "decode died")
    _, msg = conductor.router.of(P.DecodeRequest)[-1]
    assert msg.tokens == list(range(20)) + [7] + list(range(100, 112)) and msg.num_generated == 13
    from mooncake.blocks import hash_blocks
    assert msg.hashes == hash_blocks(msg.tokens, 16, FACTS.model_id)


async def test_a_stalled_node_loses_its_requests_and_recovers_when_it_progresses(conductor):
    conductor.cfg.conductor.stall_after_s = 5
    register(conductor, "d1", "decode", kv="tcp://127.0.0.1:2")
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    node = conductor.cluster.get(req.attempt.plan.decode.node_id)
    m = conductor.membership
    for n in conductor.cluster.nodes.values():
        m.heartbeat(n, P.Load(progress=1, pending=n is node), now=0.0)
    for n in conductor.cluster.nodes.values():
        m.heartbeat(n, P.Load(progress=1, pending=n is node), now=6.0)
        n.last_seen = 6.0
    m.check(now=6.0)
    assert node.stalled and node not in conductor.cluster.of_role("decode")
    assert req.attempt.plan.decode.node_id != node.node_id and req.migrations == 1
    m.heartbeat(node, P.Load(progress=2, pending=False), now=7.0)
    assert not node.stalled and node in conductor.cluster.of_role("decode")


def test_the_state_machine_refuses_transitions_it_does_not_know():
    req = Request("r", [1], [], b"", P.Sampling(), 0.0)
    with pytest.raises(TransitionError):
        req.reserved(0.0)
    with pytest.raises(TransitionError):
        req.accept(0, [1], 0.0)
    assert req.finish(P.FinishReason.ABORT) and not req.finish(P.FinishReason.STOP)


async def test_a_request_without_progress_moves_then_fails(conductor):
    conductor.cfg.conductor.request_timeout_s = 10
    conductor.cfg.conductor.max_migrations = 1
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    start = req.last_progress
    for n in conductor.cluster.nodes.values():
        n.last_seen = start + 100  # alive throughout
    conductor.check_liveness(start + 5)
    assert req.attempts == 1
    conductor.check_liveness(start + 11)
    assert req.attempts == 2 and req.migrations == 1 and not req.done
    conductor.check_liveness(req.last_progress + 11)
    assert req.done and "no progress" in events(req)[-1].error.message
