"""Check a calibrated simulation against the live cluster it was calibrated from.

The cluster replays a benchmark workload while the simulator runs the very same
requests (same prompts, hash chains and arrival times; ``requests_from_sessions``)
over the same instance counts, calibrated from the cluster's ``GET /cluster`` twice:
before the replay (what its cost models knew from start-up profiles) and after it
(refit on the workload's own requests). The comparison is of TTFT percentiles.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from mooncake.bench import BenchConfig, run_benchmark
from mooncake.bench.runner import build_sessions
from mooncake.sim.calibrate import calibrated_hardware, fetch_cluster
from mooncake.sim.hardware import FittedHardware
from mooncake.sim.setup import SimSetup
from mooncake.sim.simulator import simulate
from mooncake.sim.workload import requests_from_sessions

CALIBRATION_POINTS = ("before replay", "after replay")


@dataclass
class Validation:
    requests: int
    live_p50_s: float
    live_p90_s: float
    sim: dict[str, tuple[float, float]]  # calibration point -> simulated (TTFT p50, TTFT p90)
    hardware: dict[str, FittedHardware]  # calibration point -> what the simulation was given
    prompt_tokens: list[int]  # per request, in arrival order: what both the replay and the simulation sent

    def ratios(self, point: str) -> tuple[float, float]:
        """Simulated / live TTFT, p50 and p90."""
        p50, p90 = self.sim[point]
        return p50 / self.live_p50_s, p90 / self.live_p90_s


def validate(bench: BenchConfig, setup: SimSetup, block_tokens: int) -> Validation:
    """Replay ``bench`` against its server and simulate it on ``setup``'s instance counts.
    Every replayed request must succeed (a failed one has no TTFT to compare)."""
    requests = requests_from_sessions(build_sessions(bench), block_tokens)
    before = fetch_cluster(bench.base_url, bench.api_key)
    report = asyncio.run(run_benchmark(bench))
    after = fetch_cluster(bench.base_url, bench.api_key)
    failed = [r for r in report.records if not r.ok or r.ttft_s is None]
    if failed or len(report.records) != len(requests):
        raise RuntimeError(f"{len(failed)} of {len(requests)} replayed requests failed"
                           + (f" (first: {failed[0].error})" if failed else ""))
    sent = [r.prompt_tokens for r in sorted(report.records, key=lambda r: r.start_s)]
    if any(n is not None for n in sent) and sent != [r.prompt_tokens for r in requests]:
        raise RuntimeError("the server counted other prompt lengths than the simulation's requests")
    ttft = np.array([r.ttft_s for r in report.records])
    sim, hardware = {}, {}
    for point, cluster in zip(CALIBRATION_POINTS, (before, after)):
        hw = hardware[point] = calibrated_hardware(cluster, block_tokens)
        r = simulate(setup, hw, requests)
        sim[point] = (r.ttft_p50_s, r.ttft_p90_s)
    return Validation(len(ttft), float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90)), sim,
                      hardware, [r.prompt_tokens for r in requests])
