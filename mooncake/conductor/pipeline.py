"""The conductor's side of pipeline groups (chunked pipeline parallelism): what the scheduler needs
to estimate them, the per-stage prefill requests of a group attempt, and the stages' reports.

A group attempt is one attempt whose prefill runs on every stage: each stage gets the same
``PrefillRequest`` with its own ``StagePlan`` (layers, the group's prefix, the next stage's
activation ingress). The last stage reports ``PrefillDone``; a failure or death of any stage
moves the whole attempt, like a single instance's would.
"""

from __future__ import annotations

import math

import msgspec

from mooncake import protocol as P
from mooncake.config import Config
from mooncake.metrics import Metrics
from mooncake.sched.cluster import Cluster
from mooncake.sched.pipeline import PipelineShape, stage_layers
from mooncake.sched.scheduler import Plan


def pipeline_shape(cfg: Config, facts: P.ModelFacts, cluster: Cluster, fetch_block_s: float) -> PipelineShape | None:
    """The scheduler's view of pipeline groups, or None when they are off (or the model unknown)."""
    size = cfg.conductor.cpp_group_size
    prefills = cluster.of_role("prefill")
    if size <= 1 or not facts.block_shape or not facts.hidden_size or not prefills:
        return None
    block_bytes = prefills[0].info.block_bytes
    dtype_bytes = max(1, block_bytes // math.prod(facts.block_shape))
    rate = block_bytes / fetch_block_s if fetch_block_s > 0 else 0.0
    return PipelineShape(size, cfg.conductor.cpp_min_tokens, facts.block_shape[0], cfg.engine.prefill_chunk_tokens,
                         facts.hidden_size * dtype_bytes, rate)


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
