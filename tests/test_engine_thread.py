"""A worker's engine thread runs the most urgent call first (then in order), and a prefill
instance's interactive prompts never wait for a place flex work holds: a flood of flex work
queued before an interactive request does not stand between it and the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import CancelledError

import pytest

from mooncake import protocol as P
from mooncake.roles.engine_thread import ENGINE_URGENCY, EngineThread

from decode_workers import until

pytestmark = pytest.mark.timeout(120)


def test_engine_calls_run_by_urgency_then_in_order():
    t = EngineThread("test-engine")
    gate, order = threading.Event(), []
    try:
        t.submit(gate.wait, urgency=0)  # the call running while the others queue
        calls = [("flex1", 2), ("default1", 1), ("flex2", 2), ("priority", 0), ("default2", 1)]
        futures = [t.submit(order.append, name, urgency=u) for name, u in calls]
        gate.set()
        for f in futures:
            f.result(10)
        assert order == ["priority", "default1", "default2", "flex1", "flex2"]
    finally:
        t.shutdown()


def test_a_call_takes_its_context_s_urgency_and_its_errors_reach_the_caller():
    t = EngineThread("test-engine")
    gate, order = threading.Event(), []
    try:
        t.submit(gate.wait)
        token = ENGINE_URGENCY.set(2)  # a flex request's coroutine
        late = t.submit(order.append, "flex")
        ENGINE_URGENCY.reset(token)
        early = t.submit(order.append, "default")
        failing = t.submit(int, "not a number")
        gate.set()
        late.result(10), early.result(10)
        assert order == ["default", "flex"]
        with pytest.raises(ValueError):
            failing.result(10)
    finally:
        t.shutdown()
    with pytest.raises(RuntimeError):
        t.submit(order.append, "after")


def test_a_less_urgent_call_gives_a_request_expecting_calls_a_moment_never_more():
    t = EngineThread("test-engine", grace_s=30.0)
    order: list[str] = []
    try:
        with t.expecting(1):  # an interactive request between two of its calls
            flex = t.submit(order.append, "flex", urgency=2)
            time.sleep(0.2)
            assert order == []  # the flex call waits for the request's next call
            t.submit(order.append, "chat", urgency=1).result(10)
        flex.result(10)
        assert order == ["chat", "flex"]
        t.grace_s = 0.05
        with t.expecting(1):  # a request that waits on flex work itself gets it after the grace
            assert t.submit(lambda: "flex done", urgency=2).result(10) == "flex done"
        t.grace_s = 30.0
        with t.expecting(1), t.waiting_on_others(1):  # or at once, when it says so
            assert t.submit(lambda: "flex done", urgency=2).result(10) == "flex done"
    finally:
        t.shutdown()


def test_shutting_down_cancels_what_is_queued_when_asked():
    t = EngineThread("test-engine")
    gate = threading.Event()
    t.submit(gate.wait)
    queued = t.submit(lambda: "never")
    t.shutdown(wait=False, cancel_futures=True)
    gate.set()
    with pytest.raises(CancelledError):
        queued.result(10)


async def test_an_interactive_prompt_never_waits_for_a_place_flex_work_holds():
    from mooncake.config import Config, MiB
    from mooncake.roles.prefill import PrefillWorker

    cfg = Config()
    cfg.model.device, cfg.engine.kv_cache_bytes, cfg.engine.threads = "cpu", 16 * MiB, 1
    cfg.engine.profile_at_start, cfg.engine.max_prefill_batch = False, 1
    w = PrefillWorker(cfg)
    started: list[str] = []
    done = asyncio.Event()

    async def prefill(req: P.PrefillRequest) -> None:  # stands in for the computation
        started.append(req.req_id)
        await done.wait()

    w._prefill = prefill
    loops = [asyncio.create_task(w._work_loop(flex)) for flex in (False, True)]
    try:
        for rid, cls_name in (("flex1", "flex"), ("flex2", "flex"), ("chat", "default")):
            await w.handle(P.PrefillRequest(rid, [1, 2, 3], [], b"root", P.Sampling(request_class=cls_name), "tcp://x"), [])
        await until(lambda: len(started) == 2)
        assert sorted(started) == ["chat", "flex1"]  # flex1 holds flex work's one place; chat has its own
        assert w.load().waiting == 1 and w.busy()
        done.set()
        await until(lambda: "flex2" in started)
    finally:
        for t in loops:
            t.cancel()
        w.host.pool.shutdown(wait=False)
        w.host.ctx.term()


def test_calls_of_one_class_go_by_the_tenants_fair_order_and_never_wait_for_each_other():
    """Whole urgencies (class, priority, fair tag) beside plain class ranks: one order; a request of
    the same class and priority expecting calls gives another's no grace (grace 30 s: it would show)."""
    t = EngineThread("test-engine", grace_s=30.0)
    gate, order = threading.Event(), []
    try:
        t.submit(gate.wait, urgency=-1)
        calls = [("burst-late", (1, 0, 50.0)), ("flex", 2), ("other-tenant", (1, 0, 12.0)), ("plain-default", 1)]
        futures = [t.submit(order.append, name, urgency=u) for name, u in calls]
        gate.set()
        for f in futures:
            f.result(10)
        assert order == ["plain-default", "other-tenant", "burst-late", "flex"]
        with t.expecting((1, 0, 5.0)):
            assert t.submit(lambda: "ran", urgency=(1, 0, 80.0)).result(5) == "ran"
    finally:
        t.shutdown()


def test_a_tenants_call_gives_another_tenants_earlier_turn_its_grace_never_its_own_tenants():
    """Urgencies that name their tenant (``request_class.tenant_urgency``): a burst's call waits the
    grace for another tenant whose turn came first, not for its own tenant's earlier requests
    (grace 30 s where none is due: it would show)."""
    t = EngineThread("test-engine", grace_s=30.0)
    try:
        with t.expecting((1, 0, 5.0, "key-b")):
            assert t.submit(lambda: "own", urgency=(1, 0, 9.0, "key-b")).result(5) == "own"  # b's own later request
            assert t.submit(lambda: "ahead", urgency=(1, 0, 2.0, "key-a")).result(5) == "ahead"  # a's turn came first
            t.grace_s = 0.3
            started = time.monotonic()
            assert t.submit(lambda: "burst", urgency=(1, 0, 80.0, "key-a")).result(5) == "burst"
            assert time.monotonic() - started >= 0.3  # a's burst gave b's turn its grace
    finally:
        t.shutdown()
