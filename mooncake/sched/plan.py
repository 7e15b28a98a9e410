"""What the scheduler decides for one attempt: its prefill/decode pair, where its prefix comes
from and where new blocks go, and the predictions admission judges against the SLOs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from mooncake.protocol import FetchPlan
from mooncake.sched.node_registry import Node


@dataclass
class Plan:
    prefill: Node
    decode: Node
    fetch: list[FetchPlan]  # store segments the prefill instance reads, in chain order
    store_endpoint: str  # where new blocks are written ("" for none)
    device_blocks: int  # prefix blocks already in the prefill instance's device cache
    reusable_blocks: int  # prefix blocks reusable in all (device + stores)
    est_prefill_s: float
    est_ttft_s: float  # the chosen prefill instance's
    best_ttft_s: float  # the lowest over all instances (what admission judges)
    decode_batch: int  # predicted batch on the decode instance when this request joins it
    est_tbt_s: float
    expected_end: float  # predicted time the request finishes decoding
    decode_drain_s: float = 0.0  # from the first token until a slot of the decode instance frees
    reserve_wait_s: float = 0.0  # predicted wait for room in the decode instance's KV pool
    queue_s: float = 0.0  # predicted wait in the prefill instance's queue
    queue_slack_s: float = math.inf  # until the first token due soonest among those queued there that can make it
    decode_blocks: int = 0  # KV blocks the request is predicted to add on its decode instance
    decode_kv_tokens: int = 0  # KV tokens it holds there halfway through its output
    hashes: Sequence[bytes] = ()  # the prompt's full blocks (resident on both instances once served)
    stages: list[Node] = field(default_factory=list)  # a pipeline group, in stage order ([-1] is ``prefill``)
    # blocks [lo, hi) of the chain the prefill writes to ``store_endpoint`` (None: those it computes;
    # ``write_admission.py``), and whether the decode writes the blocks it completes
    store_range: tuple[int, int] | None = None
    decode_writes: bool = True

    @property
    def colocated(self) -> bool:
        """One colocated instance runs both halves (nothing is handed off)."""
        return self.prefill is self.decode

    @property
    def prefill_ids(self) -> list[str]:
        """The prefill instances the attempt runs on (every stage of a group)."""
        return [n.node_id for n in self.stages] or [self.prefill.node_id]
