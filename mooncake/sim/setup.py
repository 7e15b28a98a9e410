"""What one simulation is asked: the cluster size, the policy, the SLOs (no heavy imports:
the CLI reads it to build its parser)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("random", "least_loaded", "round_robin", "cache_aware")


@dataclass(frozen=True)
class SimSetup:
    prefill: int = 0
    decode: int = 0
    policy: str = "cache_aware"
    use_store: bool = True  # False: instances reuse only their own device cache
    ttft_slo_ms: float = 0.0
    tbt_slo_ms: float = 0.0
    seed: int = 0
    classes: bool = True  # False: every request is served as default, whatever its class (the baseline)
    store_writes: str = "reused"  # which blocks go to the stores ([conductor] store_writes)
    colocated: int = 0  # instances that prefill and decode in one engine (``colocated_steps.py``)
    step_tokens: int = 0  # a colocated instance's tokens per step; 0: as the live role picks it (``step_budget``)
    max_queue_wait_s: float = 0.0  # [admission] max_queue_wait_s; 0 (the simulator's default): sizing judges the SLOs alone

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated, self.step_tokens) < 0:
            raise ValueError("instance counts and step tokens must be >= 0")
        if (self.prefill > 0) != (self.decode > 0) or not (self.prefill or self.colocated):
            raise ValueError("a cluster needs at least one prefill and one decode instance, or a colocated one "
                             "(--colocated)")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
