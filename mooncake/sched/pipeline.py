"""Pipeline groups for chunked pipeline parallelism (CPP): which prefill instances act together,
each stage's layers, and a group's predicted prefill time.

Every prefill instance keeps the whole model; ``[conductor] cpp_group_size`` instances (those that
registered an activation ingress, ``act``), in node-id order, form a group, and the remainder
serves alone. Groups are formed from the live instances at each decision, so a stage that dies
drops out and the others regroup (or serve alone). A group splits the layers evenly; a prompt's
chunks enter stage 0 one after another, so stage ``i`` computes chunk ``c`` while stage ``i-1``
computes chunk ``c+1``. A group's chunks are ``1/stages`` of an instance's ``prefill_chunk_tokens``
(``group_chunk_tokens``): the pipeline's fill and drain (a chunk's time on the stages that wait for
it) shrink with the chunk, and a stage's share of a chunk (its layers) is ``1/stages`` anyway.
Its prefill time is the pipeline's: ``chunks + stages - 1`` steps of the slowest stage's share of
a chunk plus the hand-over of that chunk's hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from mooncake.config import Config
from mooncake.protocol import ModelFacts
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import PrefillCostModel
from mooncake.sched.ttft_estimate import TTFTEstimate

DEFAULT_LINK_BYTES_S = 1e9  # activation hand-over rate when no store fetch has been measured


def stage_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` layer ranges of ``stages`` stages, as even as layer counts allow."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} stages cannot split {num_layers} layers")
    return [(i * num_layers // stages, (i + 1) * num_layers // stages) for i in range(stages)]


def pipeline_groups(prefills: Sequence[Node], size: int) -> list[list[Node]]:
    """The groups of ``size`` stages the live prefill instances form (none when ``size`` is 1)."""
    if size <= 1:
        return []
    able = sorted((p for p in prefills if p.endpoints.get("act")), key=lambda p: p.node_id)
    return [able[i:i + size] for i in range(0, len(able) - size + 1, size)]


def group_chunk_tokens(chunk_tokens: int, stages: int, block_tokens: int = 1) -> int:
    """Tokens per chunk of a group of ``stages`` stages: ``1/stages`` of an instance's chunk, at
    least a block (measured on 2 stages, 6,000 tokens: 512-token chunks left a stage waiting ~2 s
    for its predecessor's larger-past chunks and for the last full chunk to drain; 256-token ones
    cut the TTFT by ~10%)."""
    return max(block_tokens, chunk_tokens // stages)


def pipeline_prefill_s(prefill_s: float, tokens: int, chunk_tokens: int, layers: list[tuple[int, int]],
                       chunk_activation_s: float) -> float:
    """Predicted prefill time of ``tokens`` through a pipeline whose one-instance prefill time is
    ``prefill_s``, cut into chunks of ``chunk_tokens`` (the group's): ``chunks + stages - 1`` steps
    (the fill and the chunks) of the slowest stage's share of a chunk plus the activation hand-over."""
    chunks = max(1, math.ceil(tokens / chunk_tokens))
    total_layers = layers[-1][1] - layers[0][0]
    slowest = max(hi - lo for lo, hi in layers) / total_layers
    step = prefill_s / chunks * slowest + chunk_activation_s
    return (chunks + len(layers) - 1) * step


@dataclass(frozen=True)
class PipelineShape:
    """What the scheduler needs to know of the model and link to predict a group's prefill."""

    group_size: int
    min_tokens: int
    num_layers: int
    chunk_tokens: int
    activation_bytes_per_token: int
    link_bytes_s: float = DEFAULT_LINK_BYTES_S

    def prefill_s(self, one_instance_s: float, tokens: int) -> float:
        """``pipeline_prefill_s`` for a group of ``group_size`` stages."""
        chunk = group_chunk_tokens(self.chunk_tokens, self.group_size)
        hand_over = chunk * self.activation_bytes_per_token / (self.link_bytes_s or DEFAULT_LINK_BYTES_S)
        return pipeline_prefill_s(one_instance_s, tokens, chunk,
                                  stage_layers(self.num_layers, self.group_size), hand_over)


def best_group(shape: PipelineShape, prefills: list[Node], prefill_cost: PrefillCostModel, estimate: TTFTEstimate,
               resident: Callable[[Node], int], queue_s: Callable[[Node], float], store_end: int, n_tokens: int,
               block_tokens: int) -> tuple[float, float, int, int, list[Node]] | None:
    """(est TTFT, prefill s, device blocks, reusable blocks, stages) of the group predicted
    fastest for this prompt; None when no group may serve it (too few tokens to compute).
    ``estimate``: the prompt's, as the scheduler's for single instances; ``resident``: a node's
    leading run of the prompt's blocks; ``queue_s``: the prefill queued ahead of the prompt on a node."""
    best = None
    for group in pipeline_groups(prefills, shape.group_size):
        dev = min(resident(p) for p in group)
        reusable = max(dev, store_end)
        cached = reusable * block_tokens
        if n_tokens - cached < shape.min_tokens:
            continue
        prefill_s = shape.prefill_s(prefill_cost.predict(n_tokens - cached, cached), n_tokens - cached)
        est = estimate.ttft_s(max(queue_s(p) for p in group), dev, reusable, prefill_s)
        if best is None or est < best[0]:
            best = (est, prefill_s, dev, reusable, group)
    return best


def pipeline_shape(cfg: Config, facts: ModelFacts, cluster: Cluster, fetch_block_s: float) -> PipelineShape | None:
    """The scheduler's view of pipeline groups, or None when they are off (or the model unknown)."""
    size = cfg.conductor.cpp_group_size
    prefills = cluster.of_role("prefill")
    if size <= 1 or not facts.block_shape or not facts.hidden_size or not prefills:
        return None
    info = prefills[0].info
    dtype_bytes = max(1, info.block_bytes // math.prod(facts.block_shape))  # the pool's, the activations'
    rate = info.moved_block_bytes / fetch_block_s if fetch_block_s > 0 else 0.0
    return PipelineShape(size, cfg.conductor.cpp_min_tokens, facts.block_shape[0], cfg.engine.prefill_chunk_tokens,
                         facts.hidden_size * dtype_bytes, rate)
