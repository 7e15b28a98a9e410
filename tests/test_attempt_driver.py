"""A frontend driving its attempts (``frontend/attempt_driver.py``) and placing them itself while
no conductor leads (``frontend/fallback.py``), as units: the order of what goes to the workers
(reserve, prefill or a group's stages, first token), failures and aborts, the fallback's choice
of workers (prefix affinity within a load slack, the least loaded decode), and a worker's
orders socket. The whole path with real processes is in ``test_failover.py`` and every
cluster test."""

from __future__ import annotations

import asyncio
from collections import Counter

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.frontend.attempt_driver import AttemptDriver, DrivenAttempt
from mooncake.frontend.fallback import AFFINITY_SLACK, FallbackPlacer
from mooncake.roles.orders import Orders

WORKERS = [P.WorkerRef("p0", "prefill", "tcp://127.0.0.1:1"), P.WorkerRef("p1", "prefill", "tcp://127.0.0.1:2"),
           P.WorkerRef("p2", "prefill", "tcp://127.0.0.1:3"),
           P.WorkerRef("d0", "decode", "tcp://127.0.0.1:4", "tcp://127.0.0.1:14"),
           P.WorkerRef("d1", "decode", "tcp://127.0.0.1:5", "tcp://127.0.0.1:15")]
P0, P1, _, D0, _ = WORKERS


class Driver(AttemptDriver):
    """The driver with its sockets replaced by a log of (node id, message)."""

    def __init__(self) -> None:
        self.prefilled: list[tuple[str, P.PrefillDone]] = []
        self.failed: list[tuple[str, P.Failed]] = []
        self.stages: list[P.StageDone] = []
        super().__init__(zmq.asyncio.Context.instance(), None, "fe", "tcp://127.0.0.1:9", 1 << 20,
                         lambda a, msg, now: self.prefilled.append((a.wire_id, msg)),
                         lambda a, msg: self.failed.append((a.wire_id, msg)), self.stages.append)
        self.sent: list[tuple[str, P.Msg]] = []

    def _send(self, worker: P.WorkerRef, msg: P.Msg) -> None:
        self.sent.append((worker.node_id, msg))


def submit(n: int, first_block: bytes = b"a", max_tokens: int = 8) -> P.Submit:
    return P.Submit(f"r{n}#1", "fe", [1, 2, 3], [first_block, b"x%d" % n], b"root",
                    P.Sampling(max_tokens=max_tokens))


def route(*prefills: P.WorkerRef, stages: list[P.StagePlan] | None = None) -> P.Route:
    return P.Route(D0, list(prefills or [P0]), b"k" * 16, [P.FetchPlan(0, 1, "tcp://store")], "tcp://store",
                   stages or [])


def test_an_attempt_reserves_on_decode_then_prefills_then_decodes_from_the_first_token():
    d = Driver()
    a = d.drive(submit(1), route())
    (node, reserve), = d.sent
    assert node == "d0" and isinstance(reserve, P.DecodeRequest) and reserve.reply_to == "tcp://127.0.0.1:9"
    assert reserve.kv_token == b"k" * 16 and reserve.store_endpoint == "tcp://store" and not reserve.fallback
    d.handle("p9", P.Reserved("r1#1", "p9"))  # not on its route: nothing
    d.handle("p0", P.Reserved("r1#1", "p0"))  # not its decode: nothing
    d.handle("p0", P.PrefillDone("r1#1", "p0", 42, 0, 3, 0.01))  # before decode reserved: nothing
    assert len(d.sent) == 1 and not d.prefilled
    d.handle("d0", P.Reserved("r1#1", "d0"))
    node, prefill = d.sent[-1]
    assert node == "p0" and isinstance(prefill, P.PrefillRequest) and prefill.decode_endpoint == "tcp://127.0.0.1:14"
    assert prefill.kv_token == b"k" * 16 and prefill.fetch == [P.FetchPlan(0, 1, "tcp://store")]
    assert a.reserved_at >= a.started
    d.handle("p0", P.PrefillDone("r1#1", "p0", 42, 0, 3, 0.01))
    assert d.sent[-1] == ("d0", P.FirstToken("r1#1", 42)) and d.prefilled[0][0] == "r1#1"
    assert d.load() == Counter({"p0": 1, "d0": 1})
    assert d.end("r1#1", abort=False) is a and not isinstance(d.sent[-1][1], P.Abort)  # decode ended it
    assert d.end("r1#1", abort=True) is None and not d.attempts and not d.load()
    d.handle("d0", P.Failed("r1#1", "d0", "late"))  # an attempt no longer driven: nothing
    assert not d.failed


def test_a_group_gets_each_stage_its_part_and_its_last_stage_reports():
    d = Driver()
    stages = [P.StagePlan(0, 2, 0, 15, 1, "tcp://act"), P.StagePlan(1, 2, 15, 30, 1)]
    d.drive(submit(1), route(P0, P1, stages=stages))
    d.handle("d0", P.Reserved("r1#1", "d0"))
    assert [(n, m.stage) for n, m in d.sent[1:]] == [("p0", stages[0]), ("p1", stages[1])]
    d.handle("p1", P.StageDone("r1#1", "p1", 1, 0.5, 0.1))
    d.handle("p0", P.PrefillDone("r1#1", "p0", 42, 0, 3, 0.01))  # not the last stage: nothing
    assert not d.prefilled and len(d.stages) == 1
    d.handle("p1", P.PrefillDone("r1#1", "p1", 42, 0, 3, 0.01, stages=2))
    assert d.prefilled and d.sent[-1] == ("d0", P.FirstToken("r1#1", 42))


def test_a_first_token_that_ends_the_request_frees_the_decode_and_failures_and_aborts_reach_everyone():
    d = Driver()
    d.drive(submit(1), route())
    d.handle("d0", P.Reserved("r1#1", "d0"))
    d.handle("p0", P.PrefillDone("r1#1", "p0", 2, 0, 3, 0.01, finished=P.FinishReason.STOP))
    assert d.sent[-1] == ("d0", P.Abort("r1#1")) and d.prefilled[0][1].finished is P.FinishReason.STOP
    d.drive(submit(2), route())
    d.handle("p0", P.Failed("r2#1", "p0", "preempted", P.FailureKind.PREEMPTED))
    assert d.failed[0][0] == "r2#1" and d.failed[0][1].kind is P.FailureKind.PREEMPTED
    d.end("r2#1", abort=True)
    assert {n for n, m in d.sent[-2:] if m == P.Abort("r2#1")} == {"p0", "d0"}


def test_the_fallback_keeps_a_prefix_on_its_prefill_until_it_is_too_far_ahead_and_decodes_balance():
    f, load = FallbackPlacer(), Counter()
    assert f.can_place(WORKERS)
    placed = []
    for i in range(AFFINITY_SLACK + 2):
        r = f.place(submit(i, b"system prompt"), 4096, load).route
        load.update(r.node_ids)
        placed.append(r)
    prefills = [r.prefills[0].node_id for r in placed]
    assert len(set(prefills[: AFFINITY_SLACK + 1])) == 1  # affinity while within the slack
    assert prefills[-1] != prefills[0]  # then the less loaded
    decodes = [r.decode.node_id for r in placed]
    assert abs(decodes.count("d0") - decodes.count("d1")) <= 1
    others = {f.place(submit(100 + i, b"prompt %d" % i), 4096, Counter()).route.prefills[0].node_id
              for i in range(12)}
    assert len(others) > 1  # other prefixes spread
    admitted = f.place(submit(1, max_tokens=10_000), 4096, Counter())
    assert admitted.max_tokens == 4096 - 3 and not admitted.route.planned  # clamped to the context
    assert len({f.place(submit(1), 4096, Counter()).route.kv_token for _ in range(3)}) == 3
    assert not FallbackPlacer().can_place([w for w in WORKERS if w.role == "decode"])


def test_the_fallback_places_on_colocated_instances_which_decode_their_own():
    c0 = P.WorkerRef("c0", "colocated", "tcp://127.0.0.1:6")
    f = FallbackPlacer()
    assert f.can_place([c0]) and not FallbackPlacer().can_place([P0])  # a prefill alone cannot serve
    route = f.place(submit(1), 4096, Counter()).route
    assert route.decode == c0 and route.prefills == [c0]
    f.can_place([P0, c0])  # a prefill without a decode is passed over
    assert {f.place(submit(i, b"p%d" % i), 4096, Counter()).route.decode.node_id for i in range(8)} == {"c0"}
    d = Driver()  # driven as a pair whose two halves are one instance
    d.drive(submit(1), route)
    d.handle("c0", P.Reserved("r1#1", "c0"))
    d.handle("c0", P.PrefillDone("r1#1", "c0", 42, 0, 3, 0.01))
    assert [(n, type(m).__name__) for n, m in d.sent] == [("c0", "DecodeRequest"), ("c0", "PrefillRequest"),
                                                          ("c0", "FirstToken")]


def test_a_fallback_attempt_says_so_to_its_workers():
    d = Driver()
    d.drive(submit(1), P.Route(D0, [P0], b"k" * 16, planned=False))
    d.handle("d0", P.Reserved("r1#1", "d0"))
    assert [m.fallback for _, m in d.sent] == [True, True]
    assert isinstance(d.attempts["r1#1"], DrivenAttempt)


async def test_a_worker_takes_only_orders_reports_to_their_frontend_and_knows_who_ordered_what():
    ctx = zmq.asyncio.Context()
    handled: list[P.Msg] = []

    async def handle(msg: P.Msg, tensors: list) -> None:
        handled.append(msg)

    orders = Orders(ctx, "127.0.0.1", None, 1 << 20, "d0", handle)
    serving = asyncio.create_task(orders.serve(lambda: ["r1#1", "r2#1"]))
    frontend = ctx.socket(zmq.DEALER)
    frontend.setsockopt(zmq.LINGER, 0)
    frontend.setsockopt(zmq.IDENTITY, P.orders_identity("f0", "a1"))
    frontend.connect(orders.endpoint)
    try:
        await frontend.send_multipart(P.encode(P.Heartbeat("x", P.Load())))  # not an order: dropped
        await frontend.send_multipart(P.encode(P.DecodeRequest("r1#1", [1], [], b"", P.Sampling())))
        await frontend.send_multipart(P.encode(P.DecodeRequest("r2#1", [1], [], b"", P.Sampling(), fallback=True)))
        for _ in range(200):
            if len(handled) == 2:
                break
            await asyncio.sleep(0.01)
        assert [type(m) for m in handled] == [P.DecodeRequest, P.DecodeRequest]
        assert orders.placed_alone(["r1#1", "r2#1", "r3#1"]) == ["r2#1"]  # marked so in a registration
        assert orders.ordered_by_frontend(P.FrontendGone("f0", "a1"), ["r1#1", "r2#1", "r3#1"]) == ["r1#1", "r2#1"]
        assert orders.ordered_by_frontend(P.FrontendGone("f0", "b2"), ["r1#1", "r2#1"]) == []  # it restarted
        assert orders.ordered_by_frontend(P.FrontendGone("f0", "", 7), ["r1#1"]) == []  # an older frontend's pid
        assert await orders.reply(P.Reserved("r1#1", "d0"))
        assert not await orders.reply(P.Reserved("r3#1", "d0"))  # no frontend ordered it
        msg, _ = P.decode(await asyncio.wait_for(frontend.recv_multipart(), 5))
        assert msg == P.Reserved("r1#1", "d0")
    finally:
        serving.cancel()
        frontend.close(0)
        orders.close()
        ctx.term()


async def test_a_worker_forgets_who_ordered_an_attempt_only_once_it_has_not_held_it_at_two_prunes():
    ctx = zmq.asyncio.Context()
    orders = Orders(ctx, "127.0.0.1", None, 1 << 20, "d0", lambda msg, tensors: asyncio.sleep(0))
    try:
        orders.ordered_by, orders.fallback = {"r1#1": b"fe", "r2#1": b"fe"}, {"r2#1"}
        orders._prune({"r1#1"})  # r2 just let go: its failure may still be on its way to the frontend
        assert await orders.reply(P.Failed("r2#1", "d0", "preempted", P.FailureKind.PREEMPTED))
        orders._prune({"r1#1"})
        assert set(orders.ordered_by) == {"r1#1"} and not orders.fallback
    finally:
        orders.close()
        ctx.term()
