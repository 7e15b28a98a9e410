"""The conductor's side of pipeline groups (chunked pipeline parallelism): each stage's part of a
group attempt (the scheduler's side: ``sched/pipeline.py``; the stages' reports go to the
frontend that drives the attempt).

A group attempt is one attempt whose prefill runs on every stage: its frontend sends each
stage the same ``PrefillRequest`` with the stage's own ``StagePlan`` (layers, the group's
prefix, the next stage's activation ingress). The last stage reports ``PrefillDone``; a failure
or death of any stage moves the whole attempt, like a single instance's would.
"""

from __future__ import annotations

from mooncake import protocol as P
from mooncake.sched.pipeline import stage_layers
from mooncake.sched.plan import Plan


def stage_plans(plan: Plan, num_layers: int) -> list[P.StagePlan]:
    """Every stage's part of the plan's group, in stage order (none for a single instance)."""
    n = len(plan.stages)
    return [P.StagePlan(i, n, lo, hi, plan.reusable_blocks, plan.stages[i + 1].endpoints["act"] if i + 1 < n else "")
            for i, (lo, hi) in enumerate(stage_layers(num_layers, n))] if n else []
