"""What one simulation is asked: the cluster size, the policy, the SLOs (no heavy imports:
the CLI reads it to build its parser)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("random", "least_loaded", "round_robin", "cache_aware")


@dataclass(frozen=True)
class SimSetup:
    prefill: int
    decode: int
    policy: str = "cache_aware"
    use_store: bool = True  # False: instances reuse only their own device cache
    ttft_slo_ms: float = 0.0
    tbt_slo_ms: float = 0.0
    seed: int = 0
    classes: bool = True  # False: every request is served as default, whatever its tier (the baseline)
    store_writes: str = "reused"  # which blocks go to the stores ([conductor] store_writes)

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode instance")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
