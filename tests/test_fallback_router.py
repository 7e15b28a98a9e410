"""A frontend placing attempts itself while no conductor leads (``frontend/fallback.py``), as a
unit: its choice of workers (prefix affinity within a load slack, the least loaded decode) and
the conductor's part it plays (reserve, prefill, first token; failures and aborts). The whole
path with real processes is in ``test_failover.py``."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.frontend.fallback import AFFINITY_SLACK, FallbackRouter
from mooncake.roles.orders import Orders

WORKERS = [P.WorkerRef("p0", "prefill", "tcp://127.0.0.1:1"), P.WorkerRef("p1", "prefill", "tcp://127.0.0.1:2"),
           P.WorkerRef("p2", "prefill", "tcp://127.0.0.1:3"),
           P.WorkerRef("d0", "decode", "tcp://127.0.0.1:4", "tcp://127.0.0.1:14"),
           P.WorkerRef("d1", "decode", "tcp://127.0.0.1:5", "tcp://127.0.0.1:15")]


def router() -> tuple[FallbackRouter, list[tuple[str, P.Msg]], list[P.Msg]]:
    told: list[P.Msg] = []
    r = FallbackRouter(zmq.asyncio.Context.instance(), None, "fe", "tcp://127.0.0.1:9", 1 << 20, told.append)
    sent: list[tuple[str, P.Msg]] = []
    r._send = lambda node_id, msg: sent.append((node_id, msg))  # type: ignore[method-assign]
    assert r.can_place(WORKERS)
    return r, sent, told


def submit(n: int, first_block: bytes, max_tokens: int = 8) -> P.Submit:
    return P.Submit(f"r{n}#1", "fe", [1, 2, 3], [first_block, b"x%d" % n], b"root",
                    P.Sampling(max_tokens=max_tokens))


def test_one_prefix_keeps_its_prefill_until_it_is_too_far_ahead_and_decodes_balance():
    r, _, _ = router()
    placed = [r.place(submit(i, b"system prompt"), 4096) for i in range(AFFINITY_SLACK + 2)]
    prefills = [a.prefill for a in placed]
    assert len(set(prefills[: AFFINITY_SLACK + 1])) == 1  # affinity while within the slack
    assert prefills[-1] != prefills[0]  # then the less loaded
    decodes = [a.decode for a in placed]
    assert abs(decodes.count("d0") - decodes.count("d1")) <= 1
    others = {r.place(submit(100 + i, b"prompt %d" % i), 4096).prefill for i in range(12)}
    assert len(others) > 1  # other prefixes spread


def test_it_drives_an_attempt_as_the_conductor_would():
    r, sent, told = router()
    admitted = r.place(submit(1, b"a", max_tokens=10_000), 4096)
    assert isinstance(admitted, P.Admitted) and admitted.max_tokens == 4096 - 3  # clamped to the context
    assert [(n, type(m)) for n, m in sent] == [(admitted.decode, P.DecodeRequest)]
    assert sent[0][1].reply_to == "tcp://127.0.0.1:9"
    r.handle("p-other", P.Reserved("r1#1", "p-other"))  # not one of its nodes: nothing
    r.handle(admitted.decode, P.Reserved("r1#1", admitted.decode))
    prefill = sent[-1][1]
    assert sent[-1][0] == admitted.prefill and isinstance(prefill, P.PrefillRequest)
    assert prefill.kv_token == sent[0][1].kv_token and prefill.decode_endpoint.startswith("tcp://127.0.0.1:1")
    r.handle(admitted.prefill, P.PrefillDone("r1#1", admitted.prefill, 42, 0, 3, 0.01))
    assert isinstance(told[-1], P.Started) and told[-1].first_token == 42
    assert sent[-1] == (admitted.decode, P.FirstToken("r1#1", 42))
    assert r.release(P.Ended("r1#1"))  # finished at the frontend: nothing to abort
    assert not r.attempts and not +r.in_flight and not isinstance(sent[-1][1], P.Abort)
    assert not r.release(P.Ended("r1#1"))  # not (any more) placed here


def test_a_failure_ends_the_attempt_everywhere_and_a_cancel_aborts_it():
    r, sent, told = router()
    a = r.place(submit(1, b"a"), 4096)
    r.handle(a.decode, P.Failed("r1#1", a.decode, "preempted", P.FailureKind.PREEMPTED))
    assert isinstance(told[-1], P.AttemptEnded) and told[-1].kind == "preempted"
    assert {n for n, m in sent if isinstance(m, P.Abort)} == {a.prefill, a.decode} and not r.attempts
    b = r.place(submit(2, b"b"), 4096)
    assert r.release(P.Ended("r2#1", abort=True))
    assert {n for n, m in sent[-2:] if isinstance(m, P.Abort)} == {b.prefill, b.decode}
    refused = FallbackRouter(zmq.asyncio.Context.instance(), None, "fe", "", 1 << 20, told.append)
    assert not refused.can_place([w for w in WORKERS if w.role == "decode"])
    assert isinstance(refused.place(submit(3, b"c"), 4096), P.Refused)


async def test_a_worker_takes_only_orders_and_reports_an_ordered_attempt_to_its_frontend():
    ctx = zmq.asyncio.Context()
    handled: list[P.Msg] = []

    async def handle(msg: P.Msg, tensors: list) -> None:
        handled.append(msg)

    orders = Orders(ctx, "127.0.0.1", None, 1 << 20, "d0", handle)
    serving = asyncio.create_task(orders.serve(lambda: ["r1#1"]))
    frontend = ctx.socket(zmq.DEALER)
    frontend.setsockopt(zmq.LINGER, 0)
    frontend.connect(orders.endpoint)
    try:
        await frontend.send_multipart(P.encode(P.Heartbeat("x", P.Load())))  # not an order: dropped
        await frontend.send_multipart(P.encode(P.DecodeRequest("r1#1", [1], [], b"", P.Sampling())))
        for _ in range(200):
            if handled:
                break
            await asyncio.sleep(0.01)
        assert [type(m) for m in handled] == [P.DecodeRequest] and orders.ordered("r1#1")
        assert await orders.reply(P.Reserved("r1#1", "d0"))
        assert not await orders.reply(P.Reserved("r2#1", "d0"))  # the conductor's: not sent here
        msg, _ = P.decode(await asyncio.wait_for(frontend.recv_multipart(), 5))
        assert msg == P.Reserved("r1#1", "d0")
    finally:
        serving.cancel()
        frontend.close(0)
        orders.close()
        ctx.term()
