"""Placement: the one decision every attempt goes through, on the conductor and in the simulator
alike. The scheduler plans it, admission judges the plan against the SLOs, and an admitted plan's
load is booked; the booking is handed back when the attempt ends."""

from __future__ import annotations

import math
from typing import Protocol, Sequence

from mooncake.sched.admission import JUDGED_LIMITS, Admission, Evidence, Rejection
from mooncake.sched.booking import Booking
from mooncake.sched.pipeline import PipelineShape
from mooncake.sched.plan import Plan
from mooncake.sched.request_class import CLASSES, DEFAULT_RANK
from mooncake.sched.write_admission import WriteAdmission


class Planner(Protocol):
    """What placement uses of the scheduler (``scheduler.Scheduler``): it plans, its write admission
    picks the blocks the stores keep, and it books an admitted plan."""

    writes: WriteAdmission

    def plan(self, hashes: Sequence[bytes], n_tokens: int, max_tokens: int, block_tokens: int, now: float,
             pipeline: PipelineShape | None = None, rank: int = DEFAULT_RANK) -> Plan | None: ...

    def book(self, req_id: str, plan: Plan, deadline: float = math.inf, rank: int = DEFAULT_RANK) -> Booking: ...


def place(scheduler: Planner, admission: Admission, booking_id: str, hashes: Sequence[bytes], n_tokens: int,
          max_tokens: int, block_tokens: int, now: float, *, pipeline: PipelineShape | None = None,
          deadline: float = math.inf, evidence: Evidence = (True, True), judge: bool = True,
          rank: int = DEFAULT_RANK, session: bool = False) -> Booking | Rejection:
    """Plan, admit and book an attempt of ``n_tokens`` (``hashes``: its full blocks) that may
    generate ``max_tokens``; its booking (``booking.plan``: the plan), or why it is refused.
    ``deadline``: when its first token is due; ``evidence``: see ``Admission.check_plan``;
    ``judge``: False for an attempt of a request admitted already (another choice of it, or its
    retry elsewhere): placed wherever the plan says, never refused for the SLOs halfway. ``rank``:
    the request's class's (``request_class.py``): it waits only for the work served before it,
    and is judged against its class's SLOs and queue bound (``[classes.<class>]``) alone: flex work is never
    refused for the interactive ones (it waits behind the rest instead). ``session``: the request
    names one (its blocks are written to the store whatever the write admission says)."""
    plan = scheduler.plan(hashes, n_tokens, max_tokens, block_tokens, now, pipeline, rank)
    limits = tuple(admission.classes.limit(CLASSES[rank], key, admission.cfg) for key in JUDGED_LIMITS)
    judged = judge and any(limits)  # a class with no SLO nor queue bound is never refused for one (nor counts as admitted)
    rejection = admission.check_plan(plan, now, evidence, limits) if judged or plan is None else None
    if rejection is not None:
        return rejection
    assert plan is not None  # check_plan refuses a missing plan
    scheduler.writes.admit(plan, hashes, session, judge, admission.metrics)  # judge: its first attempt
    return scheduler.book(booking_id, plan, deadline, rank)
