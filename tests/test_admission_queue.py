"""Admission's TTFT checks on constructed scheduler states: a newcomer is refused for the
requests queued ahead when the queue with it would not drain before the first deadline among
them that can still be met (one already predicted late does not count); a prefix a TTFT
refusal left cold is warmed up by the next request that needs it. (Prior cost model: 20 ms + 1/3 ms per token, so 40 new tokens predict ~33 ms.)"""

from __future__ import annotations

import math

import pytest

from mooncake.config import ConductorConfig
from mooncake.conductor.admission import COLD_MEMORY, Admission, Rejection
from mooncake.metrics import Metrics
from mooncake.sched.booking import PrefillQueue
from mooncake.sched.cluster import Cluster
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.scheduler import Scheduler

from test_sched import node

H = [bytes([i, 7]) * 16 for i in range(40)]


def one_prefill(**cfg: object) -> Scheduler:
    """One prefill and one decode instance: every request queues on the same prefill."""
    cluster = Cluster()
    cluster.upsert(node("p0", "prefill", "n0"))
    cluster.upsert(node("d0", "decode", "n0", kv="tcp://d0"))
    return Scheduler(ConductorConfig(**cfg), cluster, KVIndex(), PrefillCostModel(), DecodeCostModel())


def admission(slo_ms: float, metrics: Metrics | None = None) -> Admission:
    a = Admission(ConductorConfig(ttft_slo_ms=slo_ms, probe_after_s=1e9), metrics or Metrics())
    a.last_admitted = 0.0  # no probe is due
    return a


def test_the_earliest_deadline_leaves_out_requests_already_predicted_late():
    q = PrefillQueue()
    assert q.earliest_deadline(0.0) == math.inf
    q.add("a", 1.0, deadline=1.5)  # done at 1.0: can make it
    q.add("b", 1.0)  # no SLO
    assert q.earliest_deadline(0.0) == 1.5
    assert q.earliest_deadline(0.6) == math.inf  # done at 1.6 now: late
    q.add("late", 1.0, deadline=1.9)  # done at 3.0: late from the start
    q.add("c", 1.0, deadline=4.2)  # done at 4.0
    assert q.earliest_deadline(0.0) == 1.5
    q.remove("a")
    assert q.earliest_deadline(0.0) == 4.2  # not 1.9: "late" (done at 2.0) cannot be saved by refusing others


def test_the_queue_check_asks_the_queue_to_drain_before_the_first_deadline_that_can_be_met():
    """One request queued (1 s of work, due at 1.1 s): a short newcomer (~33 ms) drains with it
    in time and is admitted; behind another second of work it is refused."""
    sched = one_prefill()
    adm = admission(10_000)
    sched.queues["p0"] = q = PrefillQueue()
    q.add("a", 1.0, deadline=1.1)
    plan = sched.plan(H[:2], 40, 4, 16, now=0.0)
    assert plan.queue_slack_s == pytest.approx(1.1) and plan.est_ttft_s < 1.1
    assert adm.check_plan(plan, now=0.0) is None
    q.add("b", 1.0, deadline=9.0)
    plan = sched.plan(H[:2], 40, 4, 16, now=0.0)
    r = adm.check_plan(plan, now=0.0)
    assert isinstance(r, Rejection) and r.reason == "ttft_slo" and "queued ahead" in r.message


def test_a_request_already_predicted_late_does_not_lock_the_queue():
    sched = one_prefill()
    adm = admission(3_000)
    sched.queues["p0"] = q = PrefillQueue()
    q.add("stuck", 2.0, deadline=-0.5)  # its deadline has passed
    plan = sched.plan(H[:2], 40, 4, 16, now=0.0)
    assert plan.queue_slack_s == math.inf and plan.best_ttft_s < 3.0
    assert adm.check_plan(plan, now=0.0) is None  # it used to refuse every newcomer until "stuck" was done


def cold_plan(sched: Scheduler, first: int, n_blocks: int = 30, now: float = 0.0):
    """A prompt of ``n_blocks`` full blocks from ``H[first]`` on (plus 5 tokens), nothing cached."""
    return sched.plan(H[first:first + n_blocks], n_blocks * 16 + 5, 4, 16, now=now)


def test_a_prefix_left_cold_by_a_ttft_refusal_is_warmed_up_by_the_next_request_on_it():
    """485 tokens predict ~180 ms: over a 100 ms SLO. The first request on the prefix is
    refused; the next on the same prefix computes it (a warm-up); the one after that is planned
    behind it with the prefix counted as cached, and judged on that."""
    sched = one_prefill()
    metrics = Metrics()
    adm = admission(100, metrics)
    first = cold_plan(sched, 0)
    assert first.best_ttft_s > 0.1 and first.reusable_blocks == 0
    assert isinstance(adm.check_plan(first, now=0.0), Rejection)
    other = cold_plan(sched, 10, n_blocks=20)  # another prefix: refused, nothing to warm
    assert isinstance(adm.check_plan(other, now=0.0), Rejection)
    second = cold_plan(sched, 0)
    assert adm.check_plan(second, now=0.1) is None
    assert metrics.admission_warmups._value.get() == 1
    sched.book("second", second, deadline=0.1 + 0.1)
    third = cold_plan(sched, 0)
    assert third.device_blocks == 30  # its prefix will be resident by then
    r = adm.check_plan(third, now=0.1)
    assert isinstance(r, Rejection)  # queued behind the warm-up's ~180 ms: over the SLO
    assert metrics.admission_warmups._value.get() == 1
    sched.prefill_finished("second")
    sched.index.add("p0", "device", H[:30])
    assert adm.check_plan(cold_plan(sched, 0), now=0.3) is None  # cached: ~22 ms


def test_no_warm_up_when_the_wait_alone_misses_the_slo():
    sched = one_prefill()
    metrics = Metrics()
    adm = admission(100, metrics)
    assert isinstance(adm.check_plan(cold_plan(sched, 0), now=0.0), Rejection)
    sched.queues["p0"] = PrefillQueue()
    sched.queues["p0"].add("busy", 0.5)  # 500 ms of work ahead: warming the prefix would not help
    assert isinstance(adm.check_plan(cold_plan(sched, 0), now=0.0), Rejection)
    sched.queues["p0"].remove("busy")
    assert adm.check_plan(cold_plan(sched, 0), now=0.0) is None  # still remembered
    assert metrics.admission_warmups._value.get() == 1


def test_the_cold_memory_is_bounded_least_recent_first():
    sched = one_prefill()
    adm = admission(1)  # 1 ms: every prompt is over it
    plan = cold_plan(sched, 0, n_blocks=2)
    assert isinstance(adm.check_plan(plan, now=0.0), Rejection)
    for i in range(COLD_MEMORY):
        plan.hashes = [i.to_bytes(32, "big")] + list(plan.hashes[1:])
        assert isinstance(adm.check_plan(plan, now=0.0), Rejection)
    assert len(adm._cold) == COLD_MEMORY and H[0] not in adm._cold


def test_a_prefix_being_computed_elsewhere_is_not_warmed_up_twice():
    """Two prefill instances: while the warm-up computes the prefix on one, a request refused on
    the other (cold there) does not mark the prefix cold again, so no second warm-up computes
    it a second time alongside the first."""
    sched = one_prefill()
    sched.cluster.upsert(node("p1", "prefill", "n1"))
    metrics = Metrics()
    adm = admission(100, metrics)
    assert isinstance(adm.check_plan(cold_plan(sched, 0), now=0.0), Rejection)
    warm = cold_plan(sched, 0)
    assert adm.check_plan(warm, now=0.1) is None and metrics.admission_warmups._value.get() == 1
    sched.book("warm", warm, deadline=0.2)
    behind = cold_plan(sched, 0)
    assert behind.known_blocks == 30  # the warm-up's instance will hold it all
    assert isinstance(adm.check_plan(behind, now=0.1), Rejection)
    assert isinstance(adm.check_plan(cold_plan(sched, 0), now=0.1), Rejection)
    assert metrics.admission_warmups._value.get() == 1
