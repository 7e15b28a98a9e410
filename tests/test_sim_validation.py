"""A calibrated simulation against the live dev cluster it was calibrated from
(accuracy figures: benchmarks/bench_sim_calibration.py, BENCHMARKS.md).
Shapes: the pair only: it validates the simulator's pair model (its colocated model:
test_sim_colocated.py)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from mooncake.bench import BenchConfig
from mooncake.bench.trace import TraceScaling
from mooncake.bench.workloads import Session
from mooncake.sim.calibrate import calibrated_hardware
from mooncake.sim.setup import SimSetup
from mooncake.sim.shared_cpu import Colocation
from mooncake.sim.validate import CALIBRATION_POINTS, validate
from mooncake.sim.workload import requests_from_sessions
from mooncake.testing.cluster import running_cluster, small_config

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def test_sessions_become_requests_with_the_serving_prefix_structure() -> None:
    shared = tuple(range(100, 148))  # three 16-token blocks
    sessions = [Session("a", (shared + (1, 2, 3),), (4,), 0.0), Session("b", (shared[:40] + (9,) * 10,), (2,), 0.5)]
    a, b = requests_from_sessions(sessions, 16)
    assert (a.prompt_tokens, a.output_tokens, a.arrival_s) == (51, 4, 0.0)
    assert (b.prompt_tokens, b.output_tokens, b.arrival_s) == (50, 2, 0.5)
    assert len(a.hashes) == len(b.hashes) == 3
    assert a.hashes[:2] == b.hashes[:2] and a.hashes[2] != b.hashes[2]  # 32 shared tokens: two shared blocks
    with pytest.raises(ValueError, match="single-turn"):
        requests_from_sessions([Session("c", ((1,), (2,)), (1, 1))], 16)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared trace is not beside the repository")
def test_simulation_of_a_live_replay(tmp_path: Path) -> None:
    cfg = small_config(tmp_path)
    cfg.engine.profile_at_start = True
    scaling = TraceScaling(block_tokens=16, time_scale=0.1, max_input_tokens=600, max_output_tokens=8,
                           prefix_groups=1, max_requests=10)
    with running_cluster(cfg=cfg, prefill=2) as c:
        bc = BenchConfig(base_url=c.url, workload="trace", trace_path=str(TRACE), scaling=scaling,
                         ignore_eos=True, progress=False, timeout_s=120)
        v = validate(bc, SimSetup(2, 1), cfg.engine.block_tokens)
        cluster = httpx.get(c.url + "/cluster").json()
        assert cluster["predictions"]["ttft"]["count"] >= 10
        # Every role of a dev cluster runs on this machine (two prefill nodes of different
        # names included): the simulated ones share its cores.
        hw = calibrated_hardware(cluster, cfg.engine.block_tokens)
        assert hw.colocation == Colocation(cores=len(os.sched_getaffinity(0)), threads=1)
    assert v.requests == 10 and len(v.prompt_tokens) == 10 and max(v.prompt_tokens) <= 600
    assert set(v.sim) == set(CALIBRATION_POINTS)
    assert 0 < v.live_p50_s <= v.live_p90_s
    for point in CALIBRATION_POINTS:
        p50, p90 = v.sim[point]
        assert 0 < p50 <= p90
        assert all(r > 0 for r in v.ratios(point))
