"""Request classes in a worker: its queue and its batched prefill chunks serve ``priority``
before ``default`` before ``flex``, then lower ``priority``, then the tenants' fair order, then
arrival; an API key's class is the highest it gets."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from types import SimpleNamespace

import msgspec
import pytest

from mooncake import protocol as P
from mooncake.frontend.tenant_clock import TenantClock, tenant_id
from mooncake.roles.class_queue import ClassQueue
from mooncake.roles.prefill_batcher import PrefillBatcher, shared_budget
from mooncake.sched.request_class import served_class, urgency


def order(name: str, cls_name: str = "default", priority: int = 0) -> SimpleNamespace:
    return SimpleNamespace(name=name, sampling=P.Sampling(request_class=cls_name, priority=priority))


def test_the_served_class_and_the_order_of_classes():
    assert [served_class(t) for t in (None, "auto", "default", "flex", "priority")] == \
        ["default", "default", "default", "flex", "priority"]
    assert [served_class(t, "flex") for t in (None, "auto", "default", "priority")] == \
        ["flex", "flex", "flex", "flex"]  # the key's class is its ceiling: a higher one is served at it
    assert [served_class(t, "default") for t in (None, "flex", "priority")] == ["default", "flex", "default"]
    assert [served_class(t, "priority") for t in (None, "flex", "priority")] == ["priority", "flex", "priority"]
    keys = [urgency(P.Sampling(request_class=t, priority=p)) for t, p in
            (("priority", 9), ("default", -1), ("default", 0), ("flex", -100))]
    assert keys == sorted(keys)
    assert urgency(P.Sampling()) == urgency(P.Sampling(request_class="default"))
    # the class travels with the sampling options; the default class costs no bytes on the wire
    assert msgspec.msgpack.encode(P.Sampling(request_class="default")) == msgspec.msgpack.encode(P.Sampling())
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(P.Sampling(request_class="flex", priority=-2)), type=P.Sampling)
    assert (wire.request_class, wire.priority) == ("flex", -2)


async def test_a_queue_serves_by_class_then_priority_then_arrival():
    q: ClassQueue = ClassQueue()
    for o in (order("flex1", "flex"), order("d1"), order("flex2", "flex", -5), order("d2"),
              order("p1", "priority", 3), order("d0", priority=-1), order("p0", "priority")):
        q.put_nowait(o)
    assert q.qsize() == 7 and not q.empty()
    assert [(await q.get()).name for _ in range(7)] == ["p0", "p1", "d0", "d1", "d2", "flex2", "flex1"]
    assert q.empty()


async def test_within_a_class_and_priority_tenants_take_turns_by_their_fair_tags():
    """Tenant A's burst of four 1,500-token prompts, then, 0.5 s later, B's 600-token one: B's goes
    ahead of all of A's (its tag, its arrival plus its own tokens, is before even A's first); a
    more urgent priority still goes first."""
    now = [100.0]
    clock = TenantClock(token_s=0.001, clock=lambda: now[0])
    q: ClassQueue = ClassQueue()
    for i in range(4):
        q.put_nowait(SimpleNamespace(name=f"a{i}", sampling=P.Sampling(fair_tag=clock.tag("key-a", 1500))))
    now[0] += 0.5
    q.put_nowait(SimpleNamespace(name="b0", sampling=P.Sampling(fair_tag=clock.tag("key-b", 600))))
    q.put_nowait(SimpleNamespace(name="urgent", sampling=P.Sampling(priority=-1, fair_tag=clock.tag("key-a", 9000))))
    assert [(await q.get()).name for _ in range(6)] == ["urgent", "b0", "a0", "a1", "a2", "a3"]


async def test_a_prefill_lane_full_of_one_tenants_burst_still_starts_another_tenants_prompt():
    from mooncake.roles.class_queue import TenantSlots, next_to_start

    q: ClassQueue = ClassQueue()
    slots = TenantSlots(2)
    for i in range(4):
        q.put_nowait(SimpleNamespace(name=f"a{i}", sampling=P.Sampling(tenant="a", fair_tag=10.0 + i)))
    for _ in range(2):
        slots.take((await next_to_start(q, slots)).sampling.tenant)  # a0, a1 fill the lane
    waiting = asyncio.create_task(next_to_start(q, slots))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # a2 waits for a place
    q.put_nowait(SimpleNamespace(name="b0", sampling=P.Sampling(tenant="b", fair_tag=11.5)))
    assert (await asyncio.wait_for(waiting, 1)).name == "b0"  # b has none running: it starts past the cap
    slots.take("b")
    waiting = asyncio.create_task(next_to_start(q, slots))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    slots.release("a")
    await asyncio.sleep(0.01)
    assert not waiting.done()  # b's place past the cap still counts
    slots.release("b")
    assert (await asyncio.wait_for(waiting, 1)).name == "a2"  # the next in order, once a place frees
    assert q.qsize() == 1


def test_a_tenants_burst_of_prompts_never_keeps_another_tenants_from_reserving_on_a_colocated_instance():
    from mooncake.roles.colocated import ColocatedWorker

    def slot(tag: float, cls_name: str = "default") -> SimpleNamespace:
        return SimpleNamespace(seq=SimpleNamespace(prefilled=False, sampling=P.Sampling(request_class=cls_name, fair_tag=tag)))

    worker = SimpleNamespace(cfg=SimpleNamespace(engine=SimpleNamespace(max_prefill_batch=4)),
                             batch=SimpleNamespace(incoming={f"a{i}": slot(10.0 + i) for i in range(4)}))  # tenant A's burst holds its room

    def may(**sampling: object) -> bool:
        return ColocatedWorker.may_reserve(worker, SimpleNamespace(sampling=P.Sampling(**sampling)))  # type: ignore[arg-type]

    assert may(fair_tag=5.0)  # tenant B, ahead of A's burst in the fair order
    assert not may(fair_tag=20.0)  # A's next waits for its own burst
    assert may(request_class="priority", fair_tag=20.0) and not may(request_class="flex", fair_tag=0.0)


def test_who_gives_its_kv_room_to_whom():
    from mooncake.sched.request_class import yields_to

    def sp(cls_name: str = "default", tenant: str = "", tag: float = 0.0, priority: int = 0) -> P.Sampling:
        return P.Sampling(request_class=cls_name, tenant=tenant, fair_tag=tag, priority=priority)

    assert yields_to(sp("flex"), sp()) and not yields_to(sp("flex", tag=9), sp("flex", tag=1))  # flex to interactive only
    assert yields_to(sp(tenant="a", tag=30), sp(tenant="b", tag=7))  # a burst's later work to another tenant
    assert not yields_to(sp(tenant="a", tag=3), sp(tenant="b", tag=7))  # ahead of it in the fair order
    assert not yields_to(sp(tag=30), sp(tag=7))  # one tenant's own requests never preempt each other (no keys: all)
    assert not yields_to(sp("priority", "a", 30), sp("default", "b", 7))


def test_a_tenants_clock_keeps_its_order_weighs_and_forgets_what_is_behind_the_wall_clock():
    now = [0.0]
    clock = TenantClock(token_s=0.001, clock=lambda: now[0])
    tags = [clock.tag("a", 1000) for _ in range(3)]
    assert tags == [1.0, 2.0, 3.0]  # one tenant: its own arrival order
    assert clock.tag("heavy", 1000, weight=2.0) == 0.5  # twice the weight, half the step
    now[0] = 10.0
    assert clock.tag("a", 1000) == 11.0  # idle since: from the wall clock again, no credit banked
    clock.refund("a", 600)  # 600 of its tokens came from a cache
    assert clock.tag("a", 1000) == pytest.approx(11.4) and (clock.refund("a", 10**6) or clock.tag("a", 0)) == 10.0
    clock.refund("heavy", 1000)
    assert clock.tag("heavy", 0) == 10.0  # never behind the wall clock
    for i in range(5000):  # bounded by the tenants whose clocks run ahead of the wall clock
        now[0] += 0.01
        clock.tag(f"t{i}", 1)
    assert len(clock._last) <= 4096


def test_an_api_keys_terms_bound_the_class_and_priority_its_requests_get():
    from mooncake.api.routes import _classing
    from mooncake.config import Config

    cfg = Config()
    cfg.classes.api_key_classes = ["sk-a=default", "sk-vip=priority;min_priority=-5;weight=2"]
    frontend = SimpleNamespace(cfg=cfg, tenants=TenantClock(0.001, clock=lambda: 0.0))

    def classing(key: str, **asked: object) -> dict:
        body = SimpleNamespace(**{"service_tier": None, "priority": 0, "session_id": None, "user": None, **asked})
        return _classing(frontend, SimpleNamespace(scope={"state": {"api_key": key}}), body, 1000)

    worst = {"service_tier": "priority", "priority": -2**31}
    assert [classing(k, **worst)["request_class"] for k in ("sk-a", "sk-other", "sk-vip", "")] == \
        ["default", "default", "priority", "priority"]  # no key: no tenants, every class open
    assert [classing(k, **worst)["priority"] for k in ("sk-a", "sk-vip", "")] == [0, -5, -2**31]
    assert classing("sk-a", priority=7)["priority"] == 7  # later than its own is always allowed
    frontend.tenants = TenantClock(0.001, clock=lambda: 0.0)
    assert [classing(k)["fair_tag"] for k in ("sk-vip", "sk-a", "sk-a")] == [0.5, 1.0, 2.0]  # weight 2: half
    assert classing("sk-a")["tenant"] == tenant_id("sk-a") != tenant_id("sk-vip") and classing("")["tenant"] == ""
    assert "sk-a" not in tenant_id("sk-a")
    # OpenAI's user names a session only where the operator says so (clients send it on every request)
    assert classing("sk-a", user="u1")["keep_s"] == 0 and classing("sk-a", session_id="s1")["keep_s"] == 600
    cfg.classes.session_from_user = True
    assert classing("sk-a", user="u1")["keep_s"] == 600 and classing("sk-a", user="u1", service_tier="flex")["keep_s"] == 0


async def test_a_batch_of_prefill_chunks_gives_the_budget_to_interactive_work_first():
    """Chunks asked for together: the interactive ones, by class, in one forward of their own
    (as short as their work), the flex ones in another; both reach the engine at once (its
    thread runs the interactive one first: test_engine_thread.py)."""
    calls: list[list[str]] = []
    budgets: dict[str, int | None] = {}

    async def run_many(seqs, hooks, budget):
        calls.append([s.name for s in seqs])
        budgets.update((s.name, budget) for s in seqs)
        return [s.name for s in seqs]

    batcher = PrefillBatcher(run_many, 512, flex_chunk_tokens=128)
    asked = [order("flex", "flex"), order("chat"), order("batch", "flex", -1), order("first", "priority")]
    results = await asyncio.gather(*(batcher.chunk(o) for o in asked))
    assert sorted(calls) == [["batch", "flex"], ["first", "chat"]]
    assert results == ["flex", "chat", "batch", "first"]  # each caller gets its own sequence's step
    assert budgets == {"first": 512, "chat": 512, "batch": 128, "flex": 128}  # flex forwards are shorter
    calls.clear()
    await asyncio.gather(*(batcher.chunk(o) for o in (order("f1", "flex"), order("f2", "flex"))))
    assert calls == [["f1", "f2"]]  # flex work alone batches as before


async def test_a_tenant_whose_turn_came_first_does_not_wait_for_another_tenants_batch_in_flight():
    """While a burst's batch computes, another tenant's chunk that goes before it (fair order) goes
    to the engine at once in a batch of its own (the engine thread runs it next); a chunk of the
    burst's own tenant, or one later in the order, waits for the next batch."""
    gate, calls = asyncio.Event(), []

    async def run_many(seqs, hooks, budget):
        calls.append([s.name for s in seqs])
        if seqs[0].name == "a1":
            await gate.wait()
        return [s.name for s in seqs]

    def chunk_of(name: str, tenant: str, tag: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, sampling=P.Sampling(tenant=tenant, fair_tag=tag), tokens=[0] * 64, num_computed=0)

    batcher = PrefillBatcher(run_many, 512)
    burst = asyncio.ensure_future(batcher.chunk(chunk_of("a1", "key-a", 10.0)))
    await asyncio.sleep(0.01)
    later = [asyncio.ensure_future(batcher.chunk(chunk_of(n, t, tag))) for n, t, tag in
             (("a2", "key-a", 1.0), ("c1", "key-c", 50.0))]
    assert await batcher.chunk(chunk_of("b1", "key-b", 2.0)) == "b1"  # while a1's batch is still in flight
    assert calls == [["a1"], ["b1"]]
    gate.set()
    assert await burst == "a1" and [await f for f in later] == ["a2", "c1"]
    assert calls[2] == ["a2", "c1"]


def test_a_forward_shared_by_tenants_is_as_long_as_twice_the_first_tenants_chunks():
    """A tenant whose turn it is (its prompt first in the batch) does not wait for a forward filled
    with another tenant's backlog; one tenant's chunks fill the budget as before."""
    def seq(tenant: str, tokens: int, computed: int = 0) -> SimpleNamespace:
        return SimpleNamespace(sampling=P.Sampling(tenant=tenant), tokens=[0] * tokens, num_computed=computed)

    burst = [seq("key-a", 1500), seq("key-a", 1500, 1024)]
    assert shared_budget(burst, 512) == 512
    assert shared_budget([seq("key-b", 606, 576), *burst], 512) == 60  # b's 30 new tokens, a's 30
    assert shared_budget([seq("key-b", 2000), *burst], 512) == 512
    assert shared_budget([seq("key-b", 606, 576), seq("key-b", 700, 600), *burst], 512) == 260


def test_a_decode_instance_reserves_by_class_and_preempts_flex_work_first():
    from mooncake.roles.decode_batch import DecodeBatch, preemption_victim

    w = SimpleNamespace(pending=deque())
    for rid, cls_name, priority in (("f1", "flex", 0), ("d1", "default", 0), ("f2", "flex", -1), ("d2", "default", 0),
                                ("p1", "priority", 0), ("d0", "default", -1)):
        DecodeBatch._enqueue(w, P.DecodeRequest(rid, [1], [], b"r", P.Sampling(request_class=cls_name, priority=priority)))
    assert [m.req_id for m in w.pending] == ["p1", "d0", "d1", "d2", "f2", "f1"]

    def slot(uid: int, cls_name: str = "default") -> SimpleNamespace:
        return SimpleNamespace(seq=SimpleNamespace(uid=uid, sampling=P.Sampling(request_class=cls_name)))

    old_flex, chat, new_chat, vip = slot(1, "flex"), slot(2), slot(3), slot(4, "priority")
    assert preemption_victim([old_flex, chat, new_chat, vip]) is old_flex
    assert preemption_victim([chat, new_chat, vip]) is new_chat
    assert preemption_victim([vip, chat]) is chat


def test_each_class_is_held_to_its_own_ttft_slo():
    from mooncake.config import Config
    from mooncake.frontend.request import Request
    from mooncake.sched.request_class import limit

    cfg = Config()
    cfg.admission.ttft_slo_ms = 2000.0

    def due(cls_name: str) -> float:
        req = SimpleNamespace(arrived=10.0, generated=[], sampling=P.Sampling(request_class=cls_name))
        return Request.first_token_due(req, limit(req.sampling, "ttft_slo_ms", cfg))

    assert due("default") == due("priority") == 12.0 and due("flex") == float("inf")
    cfg.classes.flex.ttft_slo_ms = 60_000.0
    cfg.classes.priority.ttft_slo_ms = 500.0
    assert due("flex") == 70.0 and due("priority") == 10.5 and due("default") == 12.0


def test_a_decode_step_leaves_out_the_flex_work_past_the_slo():
    from mooncake.config import Config
    from mooncake.roles.decode_batch import YIELD_AT_MOST_S, DecodeBatch

    def slot(uid: int, cls_name: str = "default") -> SimpleNamespace:
        return SimpleNamespace(seq=SimpleNamespace(uid=uid, num_tokens=1000, sampling=P.Sampling(request_class=cls_name)))

    running = {str(i): slot(i, "flex" if i % 2 else "default") for i in range(6)}  # 3 of each, interleaved
    cost = SimpleNamespace(predict=lambda batch, kv: 0.010 * batch)
    w = SimpleNamespace(running=running, step_cost=cost, incoming={}, tbt_default_ms=200.0,
                        cfg=Config())
    w.cfg.admission.tbt_slo_ms = 45
    assert [s.seq.uid for s in DecodeBatch.batch(w)] == [0, 2, 4, 1]  # the oldest flex one joins
    w.cfg.classes.default.tbt_slo_ms = 55  # the default class's own SLO: one more flex joins
    assert [s.seq.uid for s in DecodeBatch.batch(w)] == [0, 2, 4, 1, 3]
    running["0"] = slot(0, "priority")
    w.cfg.classes.priority.tbt_slo_ms = 35  # the tightest class running holds them all to it
    assert [s.seq.uid for s in DecodeBatch.batch(w)] == [0, 2, 4]
    w.cfg.admission.tbt_slo_ms = w.cfg.classes.default.tbt_slo_ms = w.cfg.classes.priority.tbt_slo_ms = 0
    assert len(DecodeBatch.batch(w)) == 6  # no SLO: the default target (200 ms) holds with all six
    w.tbt_default_ms = 45  # a slower machine's default target: flex work joins only within it
    assert [s.seq.uid for s in DecodeBatch.batch(w)] == [0, 2, 4, 1]
    w.tbt_default_ms = 200.0
    reserved = slot(9)  # an interactive request's prefill runs on this machine: no flex work steps
    w.incoming["9"] = SimpleNamespace(seq=reserved.seq, msg=SimpleNamespace(prefill_beside=True),
                                      reserved_at=time.monotonic())
    assert [s.seq.uid for s in DecodeBatch.batch(w)] == [0, 2, 4]
    w.incoming["9"].reserved_at -= YIELD_AT_MOST_S + 1  # a prefill that slow gets no more of it
    assert len(DecodeBatch.batch(w)) == 6
    w.incoming["9"].reserved_at, w.incoming["9"].msg.prefill_beside = time.monotonic(), False
    assert len(DecodeBatch.batch(w)) == 6  # on another machine: it takes nothing from flex work here


def test_flex_work_waits_past_the_interactive_no_progress_timeout():
    from mooncake.config import Config
    from mooncake.frontend.frontend import Frontend
    from mooncake.frontend.request import RequestStatus

    cfg = Config()
    cfg.admission.request_timeout_s, cfg.classes.flex.request_timeout_s = 10.0, 100.0
    moved: list[str] = []

    def req(name: str, cls_name: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, sampling=P.Sampling(request_class=cls_name), status=RequestStatus.PLACED,
                               last_progress=0.0)

    fe = SimpleNamespace(cfg=cfg, requests={"a": req("chat", "default"), "b": req("batch", "flex")},
                         _move=lambda r, why, abort: moved.append(r.name))
    Frontend.check_progress(fe, 50.0)
    assert moved == ["chat"]
    Frontend.check_progress(fe, 101.0)
    assert moved == ["chat", "chat", "batch"]
