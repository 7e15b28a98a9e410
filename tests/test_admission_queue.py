"""Admission's TTFT checks on constructed scheduler states: a newcomer is refused for the
requests queued ahead when the queue with it would not drain before the first deadline among
them that can still be met (one already predicted late does not count). (Prior cost model:
20 ms + 1/3 ms per token, so 40 new tokens predict ~33 ms.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from mooncake.config import AdmissionConfig, ConductorConfig
from mooncake.sched.admission import Admission, Rejection
from mooncake.metrics import Metrics
from mooncake.protocol import Sampling
from mooncake.sched.booking import PrefillQueue
from mooncake.sched.node_registry import Cluster
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.placement import place
from mooncake.sched.request_class import DEFAULT_RANK, FLEX_RANK
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
    a = Admission(AdmissionConfig(ttft_slo_ms=slo_ms, probe_after_s=1e9), metrics or Metrics())
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


def test_a_request_waits_only_for_the_queued_work_of_its_class_and_those_before_it():
    """Ranks (``request_class.py``): 0 priority, 1 default, 2 flex."""
    q = PrefillQueue()
    q.add("flex", 5.0, rank=2)
    q.add("chat", 1.0, deadline=1.2)
    q.add("vip", 0.5, rank=0)
    assert (q.ahead_s(0), q.ahead_s(1), q.ahead_s(2)) == (0.5, 1.5, 6.5) and q.total_s == 6.5
    # served by rank: vip, chat (done at 1.5: late for 1.2), flex
    assert q.earliest_deadline(0.0, rank=1) == math.inf
    q.remove("vip")
    assert q.ahead_s(1) == 1.0 and q.earliest_deadline(0.0, rank=1) == 1.2
    assert q.earliest_deadline(0.0, rank=0) == 1.2  # a priority newcomer would delay chat too
    q.add("chat2", 1.0, deadline=0.5, rank=2)  # flex (late anyway)
    assert q.earliest_deadline(0.0, rank=2) == math.inf  # a flex newcomer delays only flex work
    q.remove("flex")
    q.remove("chat2")
    assert q.by_rank == [0.0, 1.0, 0.0] and not q.ranks
    q.add("batch", 0.1, deadline=1.5, rank=2)  # a flex request with an SLO of its own, after chat
    assert q.earliest_deadline(0.0, rank=2) == 1.5
    assert q.earliest_deadline(0.0, rank=1) == 1.2  # never refuse interactive work to keep a flex SLO
    q.remove("chat")
    assert q.earliest_deadline(0.0, rank=1) == math.inf
    q.remove("batch")
    assert q.by_rank == [0.0, 0.0, 0.0] and q.total_s == 0.0 and not q.work


def test_interactive_work_is_predicted_past_queued_flex_work_and_flex_is_never_refused_for_the_slo():
    sched = one_prefill()
    adm = admission(2_000)
    sched.queues["p0"] = q = PrefillQueue()
    for i in range(8):  # 8 s of flex work queued
        q.add(f"flex{i}", 1.0, rank=FLEX_RANK)
    chat = place(sched, adm, "chat", H[:2], 40, 4, 16, 0.0, deadline=2.0)
    assert not isinstance(chat, Rejection) and chat.plan.queue_s == 0.0 and chat.plan.est_ttft_s < 2.0
    # a default request behind 8 s of default work is refused; a flex one is booked behind it all
    q.add("backlog", 8.0)
    assert isinstance(place(sched, adm, "late", H[:2], 40, 4, 16, 0.0, deadline=2.0), Rejection)
    flex = place(sched, adm, "flex-late", H[:2], 40, 4, 16, 0.0, rank=FLEX_RANK)
    assert not isinstance(flex, Rejection) and flex.plan.queue_s >= 16.0
    assert q.ranks["flex-late"] == FLEX_RANK


def test_each_class_has_its_own_queue_cap_share_and_ttft_slo():
    adm = admission(2_000)
    adm.classes.flex.max_waiting = 3
    adm.classes.priority.max_waiting = 2
    facts = SimpleNamespace(max_model_len=4096, block_tokens=16)
    # each class's queue against its cap: [admission] max_waiting (256) unless [classes.<class>] sets one
    assert adm.check_request(40, Sampling(), facts, 0, 0, waiting=255) is None
    refused = adm.check_request(40, Sampling(request_class="flex"), facts, 0, 0, waiting=3)
    assert isinstance(refused, Rejection) and refused.status == 503 and "3 requests are queued" in refused.message
    assert isinstance(adm.check_request(40, Sampling(request_class="priority"), facts, 0, 0, waiting=2), Rejection)
    # a class holds at most its share of max_requests (1024) in flight: flex half by default
    assert adm.check_request(40, Sampling(request_class="flex"), facts, 0, 600, waiting=0, class_in_flight=511) is None
    full = adm.check_request(40, Sampling(request_class="flex"), facts, 0, 600, waiting=0, class_in_flight=512)
    assert isinstance(full, Rejection) and full.status == 503 and "[classes.flex] max_share" in full.message
    assert adm.check_request(40, Sampling(), facts, 0, 600, waiting=0, class_in_flight=88) is None
    # priority at most 0.8 by default: the classes below it always make progress
    assert adm.check_request(40, Sampling(request_class="priority"), facts, 0, 900, waiting=0, class_in_flight=818) is None
    full = adm.check_request(40, Sampling(request_class="priority"), facts, 0, 900, waiting=0, class_in_flight=819)
    assert isinstance(full, Rejection) and "[classes.priority] max_share" in full.message
    sched = one_prefill()
    sched.queues["p0"] = q = PrefillQueue()
    q.add("backlog", 8.0)
    q.add("flex-a", 1.0, rank=FLEX_RANK)
    assert (sched.waiting(), sched.waiting(FLEX_RANK), sched.waiting(DEFAULT_RANK), sched.waiting(0)) == (2, 1, 1, 0)
    # behind 9 s of work, a flex request with a 5 s SLO of its own is refused for it, and one with 60 s is not
    adm.classes.flex.ttft_slo_ms = 5_000
    late = place(sched, adm, "flex-b", H[:2], 40, 4, 16, 0.0, rank=FLEX_RANK)
    assert isinstance(late, Rejection) and late.reason == "ttft_slo" and "5000 ms" in late.message
    assert sched.in_flight(FLEX_RANK) == 0
    adm.classes.flex.ttft_slo_ms = 60_000
    assert not isinstance(place(sched, adm, "flex-c", H[:2], 40, 4, 16, 0.0, rank=FLEX_RANK), Rejection)
    assert (sched.in_flight(FLEX_RANK), sched.in_flight(DEFAULT_RANK)) == (1, 0)
    sched.release("flex-c")
    assert sched.in_flight(FLEX_RANK) == 0
