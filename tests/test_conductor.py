"""The conductor's side of a request without workers or frontends: admission, placement and
booking, the route a frontend drives, the frontend's reports (prefills done, attempts ended),
attempts ending with lost nodes (a worker's or a frontend's)."""

from __future__ import annotations

import time

import msgspec
import pytest

from mooncake import protocol as P
from mooncake.conductor import Conductor
from mooncake.conductor.attempt import Attempt
from mooncake.config import Config
from mooncake.sched.admission import Rejection
from mooncake.sched.node_registry import Node

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
    info = P.NodeInfo("n0", 1, FACTS if role in ("prefill", "decode") else None, num_blocks=64)
    reply = c.membership.register(node_id.encode(), P.Register(role, node_id, info, endpoints), 0.0)
    assert isinstance(reply, P.Registered)
    return c.cluster.get(node_id)


@pytest.fixture
async def conductor():
    cfg = Config()
    cfg.admission.max_requests = 2
    c = Conductor(cfg, model_name="m")
    c.router = Sent()
    register(c, "p0", "prefill", orders="tcp://127.0.0.1:3")
    register(c, "d0", "decode", kv="tcp://127.0.0.1:1", orders="tcp://127.0.0.1:4")
    register(c, "f0", "frontend", tokens="tcp://127.0.0.1:9")
    yield c
    await c.close()


def submit_msg(tokens: list[int], max_tokens: int = 8, n: int = 1, owner: str = "f0", generated: int = 0,
               in_flight: int = 0) -> P.Submit:
    from mooncake.blocks import hash_blocks, root_hash

    return P.Submit(f"req-{tokens[0] if tokens else 0}-{owner}#{n}", owner, tokens,
                    hash_blocks(tokens, 16, FACTS.model_id), root_hash(FACTS.model_id),
                    P.Sampling(max_tokens=max_tokens), generated, in_flight=in_flight,
                    new_request=n == 1 and not generated)


def submit(c: Conductor, tokens: list[int], max_tokens: int = 8, n: int = 1, owner: str = "f0",
           generated: int = 0, in_flight: int = 0) -> Attempt | Rejection:
    c.requests_in_flight[owner] = in_flight
    return c.submit(submit_msg(tokens, max_tokens, n, owner, generated, in_flight))


def prefilled(c: Conductor, a: Attempt, first: int = 7, owner: str = "f0") -> None:
    done = P.PrefillDone(a.wire_id, "p0", first, 0, len(a.submit.tokens), 0.01)
    c._on_release(c.cluster.get(owner), P.Release(owner, prefilled=[P.Prefilled(a.wire_id, done, 0.001, 0.012)]))


async def test_a_placed_attempt_is_answered_with_its_route_and_booked_until_its_frontend_reports(conductor):
    msg = submit_msg([1, 2, 3], 4)
    conductor._on_submit(conductor.cluster.get("f0"), msg)
    (owner, admitted), = conductor.router.of(P.Admitted)
    route = admitted.route
    assert owner == "f0" and admitted.max_tokens == 4 and route.planned and len(route.kv_token) == 16
    assert route.decode == P.WorkerRef("d0", "decode", "tcp://127.0.0.1:4", "tcp://127.0.0.1:1")
    assert route.prefills == [P.WorkerRef("p0", "prefill", "tcp://127.0.0.1:3")] and not route.stages
    assert [type(m) for _, m in conductor.router.log] == [P.Admitted]  # the frontend drives the workers
    a = conductor.attempts[msg.wire_id]
    assert conductor.scheduler.assigned("d0") == 1 and conductor.scheduler.queued("p0") == 1
    prefilled(conductor, a)
    assert a.prefilled and conductor.scheduler.queued("p0") == 0 and conductor.scheduler.assigned("d0") == 1
    conductor._on_release(conductor.cluster.get("f0"), P.Release("f0", [P.Ended(a.wire_id, False, 3, 0.3)]))
    assert conductor.scheduler.assigned("d0") == 0 and a.wire_id not in conductor.attempts
    assert not conductor.router.of(P.Abort)  # decode ended it itself
    conductor._on_submit(conductor.cluster.get("f0"), msg)  # asked again (a re-registered frontend)
    assert len(conductor.router.of(P.Admitted)) == 2


async def test_requests_in_flight_are_bounded_and_an_aborting_release_frees_the_workers(conductor):
    a = submit(conductor, [1, 2, 3], in_flight=0)
    submit(conductor, [4, 5, 6], in_flight=1)
    r = submit(conductor, [7, 8, 9], in_flight=2)
    assert isinstance(r, Rejection) and r.status == 503 and r.reason == "overloaded" and r.retry_after_s
    assert conductor.scheduler.assigned("d0") == 2 and conductor.scheduler.queued("p0") == 2
    conductor._on_release(conductor.cluster.get("f0"), P.Release("f0", [P.Ended(a.wire_id, abort=True)]))
    assert conductor.scheduler.assigned("d0") == 1 and a.wire_id not in conductor.attempts
    assert {n for n, m in conductor.router.of(P.Abort) if m.req_id == a.wire_id} == {"p0", "d0"}
    # another frontend cannot release what is not its own
    b = submit(conductor, [8, 9], in_flight=1)
    register(conductor, "f1", "frontend", tokens="tcp://127.0.0.1:10")
    conductor._on_release(conductor.cluster.get("f1"), P.Release("f1", [P.Ended(b.wire_id, abort=True)]))
    prefilled(conductor, b, owner="f1")
    assert b.wire_id in conductor.attempts and not b.prefilled


async def test_prompt_checks_and_max_tokens_clamp(conductor):
    r = submit(conductor, list(range(128)), 4)
    assert isinstance(r, Rejection) and r.reason == "context_length_exceeded" and r.param == "prompt"
    a = submit(conductor, list(range(100)), 500)
    assert a.submit.sampling.max_tokens == 28


async def test_no_workers_is_503_and_a_prompt_larger_than_every_pool_is_400():
    c = Conductor(Config(), model_name="m")
    c.router = Sent()
    register(c, "f0", "frontend", tokens="tcp://x")
    r = submit(c, [1])
    assert isinstance(r, Rejection) and r.status == 503 and r.reason == "no_workers"
    register(c, "p0", "prefill")
    register(c, "d0", "decode", kv="tcp://x")
    c.cluster.get("d0").info = P.NodeInfo("n0", 1, FACTS, num_blocks=2)
    r = submit(c, list(range(40)))
    assert isinstance(r, Rejection) and r.status == 400 and "KV blocks" in r.message
    await c.close()


async def test_block_events_feed_the_index_and_a_dead_node_leaves_it(conductor):
    p0 = conductor.cluster.get("p0")
    conductor.membership.block_event(p0, P.BlockEvent("p0", "stored", "device", [b"a" * 32, b"b" * 32]))
    conductor.membership.block_event(p0, P.BlockEvent("p0", "removed", "device", [b"a" * 32]))
    assert conductor.index.holders(b"b" * 32) == {"p0": "device"} and len(conductor.index) == 1
    conductor.membership.check(now=1e9)  # everyone silent since t=0
    assert len(conductor.index) == 0 and conductor.cluster.get("p0") is None


async def test_a_heartbeat_carries_the_blocks_a_node_cached_since_its_last(conductor):
    p0 = conductor.cluster.get("p0")
    conductor._on_heartbeat(p0, P.Heartbeat("p0", P.Load(), [P.BlockEvent("p0", "removed", "device", [b"a" * 32]),
                                                             P.BlockEvent("p0", "stored", "device", [b"b" * 32])]))
    assert conductor.index.holders(b"b" * 32) == {"p0": "device"} and len(conductor.index) == 1


async def test_a_node_restarted_under_the_same_pid_is_told_apart_by_its_instance(conductor):
    """In a container every role may be pid 1: a registration from another process start (another
    ``instance``) drops what the old one held from the index; the same start re-registering keeps it."""
    p0 = conductor.cluster.get("p0")
    conductor.membership.block_event(p0, P.BlockEvent("p0", "stored", "device", [b"b" * 32]))
    for instance, kept in (("", True), ("second-start", False)):
        info = P.NodeInfo("n0", 1, FACTS, num_blocks=64, instance=instance)
        conductor.membership.register(b"p0", P.Register("prefill", "p0", info, {"orders": "tcp://127.0.0.1:3"}), 1.0)
        assert (conductor.index.holders(b"b" * 32) == {"p0": "device"}) is kept


async def test_a_registering_node_keeps_only_the_attempts_that_still_run_there(conductor):
    a = submit(conductor, [1, 2, 3])
    info = P.NodeInfo("n0", 1, FACTS, num_blocks=64)
    holding = [a.wire_id, "gone#1", "other-request#3"]  # one live attempt, two the conductor never knew
    reply = conductor.membership.register(b"d0", P.Register("decode", "d0", info, {"kv": "tcp://127.0.0.1:1"},
                                                            holding=holding), 1.0)
    assert reply.keep == [a.wire_id]
    reply = conductor.membership.register(b"p9", P.Register("prefill", "p9", info, holding=[a.wire_id]), 1.0)
    assert reply.keep == []  # the attempt runs, but not on p9
    assert conductor.metrics.reconciliation_aborts._value.get() == 3


def started() -> Conductor:
    """A conductor that has just started (its adoption window open), with frontend f0 registered."""
    c = Conductor(Config(), model_name="m")
    c.router = Sent()
    c.adoption.begin(time.monotonic())
    register(c, "f0", "frontend", tokens="tcp://127.0.0.1:9")
    return c


def register_holding(c: Conductor, node_id: str, role: str, holding: list[str]) -> P.Registered:
    info = P.NodeInfo("n0", 1, FACTS, num_blocks=64)
    endpoints = {"kv": "tcp://127.0.0.1:1", "orders": "tcp://127.0.0.1:4"} if role == "decode" else \
        {"orders": "tcp://127.0.0.1:3"}
    return c._on_register(node_id.encode(), P.Register(role, node_id, info, endpoints, holding=holding))


async def test_a_new_conductor_adopts_what_its_frontends_claim_and_drops_what_nobody_claims(conductor):
    a = submit(conductor, [1, 2, 3] * 20, max_tokens=8)  # placed by the conductor that is gone
    c = started()
    assert register_holding(c, "p0", "prefill", [a.wire_id, "orphan#1"]).keep == [a.wire_id, "orphan#1"]
    c._on_claims(c.cluster.get("f0"), P.Claims("f0", [P.Claim(a.submit, a.route)]))
    assert a.wire_id not in c.attempts  # its decode has not registered yet
    assert register_holding(c, "d0", "decode", [a.wire_id]).keep == [a.wire_id]
    adopted = c.attempts[a.wire_id]
    assert adopted.owner == "f0" and adopted.nodes == {"p0", "d0"} and adopted.route == a.route
    assert c.scheduler.queued("p0") == 1 and c.scheduler.assigned("d0") == 1
    assert c.metrics.adopted_attempts._value.get() == 1
    prefilled(c, adopted)
    assert c.scheduler.queued("p0") == 0 and adopted.prefilled
    c._settle_adoption(time.monotonic())  # in the window: nothing yet
    assert not c.router.of(P.Abort)
    c._settle_adoption(time.monotonic() + 60)
    assert c.router.of(P.Abort) == [("p0", P.Abort("orphan#1"))]
    assert c.metrics.reconciliation_aborts._value.get() == 1 and not c.router.of(P.AttemptEnded)
    c._on_release(c.cluster.get("f0"), P.Release("f0", [P.Ended(a.wire_id)]))
    assert not c.attempts and c.scheduler.assigned("d0") == 0


async def test_a_claim_whose_instances_do_not_come_back_ends_when_the_window_closes(conductor):
    a, b = submit(conductor, [1, 2, 3]), submit(conductor, [4, 5, 6])
    c = started()
    register_holding(c, "p0", "prefill", [])
    c._on_claims(c.cluster.get("f0"), P.Claims("f0", [P.Claim(a.submit, a.route), P.Claim(b.submit, b.route)]))
    c._on_release(c.cluster.get("f0"), P.Release("f0", [P.Ended(b.wire_id)]))  # b ends before it is adopted
    c._settle_adoption(time.monotonic() + 60)
    (owner, ended), = c.router.of(P.AttemptEnded)
    assert owner == "f0" and ended.wire_id == a.wire_id and ended.kind == "retry"
    assert not c.attempts and not c.adoption.claims


async def test_a_worker_keeps_what_a_frontend_placed_alone_until_it_is_claimed_or_past_due(conductor):
    info = P.NodeInfo("n0", 1, FACTS, num_blocks=64)
    reply = conductor.membership.register(b"d0", P.Register("decode", "d0", info, {"kv": "tcp://127.0.0.1:1"},
                                                            holding=["alone#1", "alone#2", "gone#1"],
                                                            fallback=["alone#1", "alone#2"]), 1.0)
    assert reply.keep == ["alone#1", "alone#2"]  # the window is closed: a planned one unknown here goes
    msg = submit_msg([1, 2, 3])
    route = msgspec.structs.replace(submit(conductor, [9, 9, 9]).route, planned=False)
    claim = P.Claim(msgspec.structs.replace(msg, wire_id="alone#1"), route)
    conductor._on_claims(conductor.cluster.get("f0"), P.Claims("f0", [claim]))
    assert "alone#1" in conductor.attempts
    conductor._settle_adoption(time.monotonic() + 60)
    assert conductor.router.of(P.Abort) == [("d0", P.Abort("alone#2"))]  # its frontend never claimed it


async def test_after_the_window_a_claim_unknown_here_ends_unless_the_frontend_placed_it_itself(conductor):
    a, b = submit(conductor, [1, 2, 3]), submit(conductor, [4, 5, 6])
    for attempt in (a, b):
        conductor._end(attempt, abort=False)  # e.g. its frontend was declared dead meanwhile
    fallback = msgspec.structs.replace(b.route, planned=False)
    conductor._on_claims(conductor.cluster.get("f0"), P.Claims("f0", [P.Claim(a.submit, a.route),
                                                                     P.Claim(b.submit, fallback, prefilled=True)]))
    (owner, ended), = conductor.router.of(P.AttemptEnded)
    assert owner == "f0" and ended.wire_id == a.wire_id
    assert list(conductor.attempts) == [b.wire_id] and conductor.attempts[b.wire_id].prefilled
    conductor.on_node_lost(conductor.cluster.get("f0"), "frontend died")  # now its frontend's death frees it
    assert not conductor.attempts and ("d0", P.FrontendGone("f0", "", 1)) in conductor.router.of(P.FrontendGone)


async def test_reports_of_an_ended_attempt_are_ignored(conductor):
    a = submit(conductor, [1, 2, 3])
    conductor.on_node_lost(conductor.cluster.get("d0"), "decode died")
    (owner, ended), = conductor.router.of(P.AttemptEnded)
    assert owner == "f0" and ended.kind == "retry" and "decode died" in ended.message
    assert conductor.scheduler.queued("p0") == 0
    assert {n for n, _ in conductor.router.of(P.Abort)} == {"p0", "d0"}
    prefilled(conductor, a)
    conductor._on_release(conductor.cluster.get("f0"), P.Release("f0", [P.Ended(a.wire_id, abort=True)]))
    assert len(conductor.router.of(P.Abort)) == 2 and not a.prefilled  # nothing more


async def test_a_lost_worker_ends_its_attempts_and_a_lost_frontend_has_its_attempts_dropped(conductor):
    a = submit(conductor, [1, 2, 3])
    prefilled(conductor, a)
    conductor.on_node_lost(conductor.cluster.get("d0"), "decode died")
    (_, ended), = conductor.router.of(P.AttemptEnded)
    assert ended.wire_id == a.wire_id and ended.kind == "retry" and "decode died" in ended.message
    b = submit(conductor, [4, 5, 6], owner="f0")
    conductor.router.log.clear()
    conductor.on_node_lost(conductor.cluster.get("f0"), "frontend died")
    assert b.wire_id not in conductor.attempts and conductor.scheduler.assigned("d0") == 0
    assert conductor.router.of(P.FrontendGone) == [("p0", P.FrontendGone("f0", "", 1)), ("d0", P.FrontendGone("f0", "", 1))]
    assert not conductor.router.of(P.AttemptEnded) and conductor.metrics.frontend_aborts._value.get() == 1


async def test_a_stalled_node_loses_its_attempts_and_recovers_when_it_progresses(conductor):
    conductor.cfg.liveness.stall_after_s = 5
    register(conductor, "d1", "decode", kv="tcp://127.0.0.1:2", orders="tcp://127.0.0.1:5")
    a = submit(conductor, [1, 2, 3])
    node = conductor.cluster.get(a.plan.decode.node_id)
    m = conductor.membership
    for n in conductor.cluster.nodes.values():
        m.heartbeat(n, P.Load(progress=1, pending=n is node), now=0.0)
    for n in conductor.cluster.nodes.values():
        m.heartbeat(n, P.Load(progress=1, pending=n is node), now=6.0)
        n.last_seen = 6.0
    m.check(now=6.0)
    assert node.stalled and node not in conductor.cluster.of_role("decode")
    assert a.wire_id not in conductor.attempts and conductor.router.of(P.AttemptEnded)[0][1].kind == "retry"
    m.heartbeat(node, P.Load(progress=2, pending=False), now=7.0)
    assert not node.stalled and node in conductor.cluster.of_role("decode")


async def test_frontends_hear_of_the_cluster_on_heartbeats(conductor):
    conductor._on_heartbeat(conductor.cluster.get("f0"), P.Heartbeat("f0", P.Load(running=3, waiting=1)))
    (_, view), = conductor.router.of(P.ClusterView)
    assert view.ready and view.facts == FACTS and view.nodes["decode"] == 1 and view.nodes["frontend"] == 1
    assert conductor.requests_in_flight["f0"] == 4 and not view.snapshot
    assert conductor.view(snapshot=True).snapshot["frontends"] == ["f0"]


async def test_frontends_hear_of_a_change_of_membership_unasked_and_the_view_is_built_once_a_change(conductor):
    """A busy frontend sends no heartbeat (its Submits stand in): the liveness check that follows
    a change tells every frontend, once."""
    view = conductor.view()
    assert conductor.view() is view  # nothing changed: the same view, not built again
    conductor.views.tell_if_changed()
    conductor.router.log.clear()
    conductor.views.tell_if_changed()
    assert conductor.router.of(P.ClusterView) == []
    conductor.membership.leave(conductor.cluster.get("d0"))  # draining: no new work there
    conductor.views.tell_if_changed()
    conductor.views.tell_if_changed()
    (to, told), = conductor.router.of(P.ClusterView)
    assert to == "f0" and told is not view and told.nodes["decode"] == 0 and not told.ready


async def test_a_claim_on_an_instance_that_restarted_ends_and_a_dead_frontend_s_claims_go(conductor):
    a, b = submit(conductor, [1, 2, 3]), submit(conductor, [4, 5, 6])
    c = started()
    register(c, "f1", "frontend", tokens="tcp://127.0.0.1:8")
    register_holding(c, "p0", "prefill", [])
    c._on_claims(c.cluster.get("f0"), P.Claims("f0", [P.Claim(a.submit, a.route)]))
    other = msgspec.structs.replace(b.submit, node_id="f1")
    c._on_claims(c.cluster.get("f1"), P.Claims("f1", [P.Claim(other, b.route)]))
    c.on_node_lost(c.cluster.get("f1"), "frontend died")
    assert list(c.adoption.claims) == [a.wire_id]  # f1's went with it
    info = P.NodeInfo("n0", 2, FACTS, num_blocks=64)  # d0 is back as another process: orders elsewhere
    c._on_register(b"d0", P.Register("decode", "d0", info, {"kv": "tcp://127.0.0.1:1", "orders": "tcp://127.0.0.1:7"},
                                     holding=[]))
    (owner, ended), = c.router.of(P.AttemptEnded)
    assert owner == "f0" and ended.wire_id == a.wire_id and "restarted" in ended.message
    assert not c.attempts and not c.adoption.claims


async def test_a_worker_registering_after_the_window_keeps_what_a_frontend_has_claimed(conductor):
    a = submit(conductor, [1, 2, 3])
    c = started()
    c._on_claims(c.cluster.get("f0"), P.Claims("f0", [P.Claim(a.submit, a.route)]))
    c.adoption.until = 0.0  # the window closed before p0 and d0 came back
    assert register_holding(c, "p0", "prefill", [a.wire_id]).keep == [a.wire_id]
    assert register_holding(c, "d0", "decode", [a.wire_id, "other#1"]).keep == [a.wire_id]
    assert a.wire_id in c.attempts


async def test_a_request_with_n_choices_counts_n_against_the_caps(conductor):
    """max_requests is 2 here: a request with 3 choices could never be taken (a 400 naming n); with
    2 choices beside 1 in flight it would bring 3 (503, try again); alone it is admitted and counts 2
    (its forks are admitted with it, not as new requests)."""
    msg = submit_msg(list(range(40)), 4)
    msg.choices = 3
    r = conductor.submit(msg)
    assert isinstance(r, Rejection) and r.status == 400 and r.param == "n"
    msg = submit_msg(list(range(40)), 4, in_flight=1)
    msg.choices = 2
    conductor.requests_in_flight["f0"] = 1
    r = conductor.submit(msg)
    assert isinstance(r, Rejection) and r.reason == "overloaded"
    conductor.requests_in_flight["f0"] = 0
    msg = submit_msg(list(range(1, 41)), 4)
    msg.choices = 2
    conductor._on_submit(conductor.cluster.get("f0"), msg)
    assert msg.wire_id in conductor.attempts and conductor.requests_in_flight["f0"] == 2
    fork = submit_msg(list(range(1, 41)), 4, n=2, in_flight=2)  # a fork's first attempt: not a new request
    assert not fork.new_request and not isinstance(conductor.submit(fork), Rejection)


async def test_only_a_new_request_is_judged_against_the_slos(conductor, monkeypatch):
    """Another choice of an admitted request (a fork) or its retry elsewhere is placed, never
    refused for the SLOs halfway; a new request is judged."""
    conductor.cfg.admission.ttft_slo_ms = 0.001  # every prediction misses it
    monkeypatch.setattr(conductor.costs, "evidence", lambda: (True, True))
    conductor.admission.last_admitted = time.monotonic()  # no probe due
    r = submit(conductor, [1, 2, 3])
    assert isinstance(r, Rejection) and r.status == 429 and r.reason == "ttft_slo"
    fork = submit(conductor, [1, 2, 3], n=2)
    moved = submit(conductor, [4, 5, 6], generated=3)
    assert isinstance(fork, Attempt) and isinstance(moved, Attempt)
