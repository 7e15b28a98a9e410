"""The conductor's side of pipeline groups (chunked pipeline parallelism): the per-stage prefill
requests of a group attempt, and the stages' reports (the scheduler's side: ``sched/pipeline.py``).

A group attempt is one attempt whose prefill runs on every stage: each stage gets the same
``PrefillRequest`` with its own ``StagePlan`` (layers, the group's prefix, the next stage's
activation ingress). The last stage reports ``PrefillDone``; a failure or death of any stage
moves the whole attempt, like a single instance's would.
"""

from __future__ import annotations

import msgspec

from mooncake import protocol as P
from mooncake.metrics import Metrics
from mooncake.sched.pipeline import stage_layers
from mooncake.sched.plan import Plan


def stage_requests(plan: Plan, prefill: P.PrefillRequest, num_layers: int) -> list[tuple[str, P.PrefillRequest]]:
    """(node id, request) for every stage of the plan's group, in stage order."""
    n = len(plan.stages)
    out = []
    for i, (node, (lo, hi)) in enumerate(zip(plan.stages, stage_layers(num_layers, n))):
        nxt = plan.stages[i + 1].endpoints["act"] if i + 1 < n else ""
        stage = P.StagePlan(i, n, lo, hi, plan.reusable_blocks, nxt)
        out.append((node.node_id, msgspec.structs.replace(prefill, stage=stage)))
    return out


def record_stage(metrics: Metrics, msg: P.StageDone) -> None:
    """A stage's report: its compute and idle seconds, the activations it handed on."""
    stage = str(msg.stage)
    metrics.stage_compute.labels(stage).inc(max(0.0, msg.compute_s))
    metrics.stage_idle.labels(stage).inc(max(0.0, msg.idle_s))
    metrics.activation_bytes.inc(max(0, msg.activation_bytes))
    metrics.stage_kv_inflight.observe(max(0, msg.kv_pending_bytes))
