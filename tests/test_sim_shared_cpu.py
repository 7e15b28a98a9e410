"""Co-located simulated instances share their machine's cores (processor sharing), and a
calibration from a cluster whose engines all run on one machine says so."""

from __future__ import annotations

import pytest

from mooncake.sim.calibrate import calibrated_hardware
from mooncake.sim.hardware import Capacities, FittedHardware, LinearCosts
from mooncake.sim.setup import SimSetup
from mooncake.sim.shared_cpu import Colocation, SharedCpu
from mooncake.sim.simulator import Simulation
from mooncake.sim.workload import SimRequest

UNBOUNDED = 1 << 40
CAPS = Capacities(prefill_cache_blocks=UNBOUNDED, decode_kv_tokens=UNBOUNDED, decode_max_batch=32,
                  colocated_kv_tokens=UNBOUNDED, store_dram_blocks=UNBOUNDED, store_lmdb_blocks=UNBOUNDED)
# 1 ms per prompt token, 10 ms per decode step, nothing else.
COSTS = LinearCosts(prefill_fixed_s=0.0, prefill_per_token_s=0.001, prefill_per_pair_s=0.0, decode_step_s=0.01,
                    decode_per_seq_s=0.0, fetch_block_s=0.0, transfer_token_s=0.0)


def hardware(colocation: Colocation | None) -> FittedHardware:
    return FittedHardware("test", 16, COSTS, CAPS, colocation=colocation)


def request(i: int, arrival: float, prompt: int, output: int) -> SimRequest:
    hashes = tuple((1000 * i + b).to_bytes(8, "little") for b in range(prompt // 16))
    return SimRequest(f"r{i}", arrival, prompt, output, hashes)


def ttfts(colocation: Colocation | None, requests: list[SimRequest], prefill: int = 2) -> dict[str, float]:
    sim = Simulation(SimSetup(prefill, 1, "least_loaded", use_store=False), hardware(colocation), requests)
    sim.run()
    return {k: o.ttft_s for k, o in sim.outcomes.items()}


def test_speed_is_cores_over_demand_and_capped_at_one() -> None:
    cpu = SharedCpu(Colocation(cores=2, threads=1))
    assert cpu.speed() == 1.0
    assert cpu.set_computing("a", True) and not cpu.set_computing("a", True)
    cpu.set_computing("b", True)
    assert cpu.speed() == 1.0
    cpu.set_computing("c", True)
    assert cpu.speed() == pytest.approx(2 / 3)
    assert cpu.set_computing("c", False) and cpu.speed() == 1.0
    assert SharedCpu(Colocation(cores=2, threads=2)).set_computing("a", True)
    with pytest.raises(ValueError):
        Colocation(cores=0)


def test_two_prefills_on_one_core_take_twice_as_long() -> None:
    both = [request(0, 0.0, 1000, 1), request(1, 0.0, 1000, 1)]
    alone = ttfts(None, both)
    assert alone == pytest.approx({"r0": 1.0, "r1": 1.0}, abs=1e-6)  # each instance on its own hardware
    assert ttfts(Colocation(cores=2), both) == pytest.approx(alone, abs=1e-6)
    assert ttfts(Colocation(cores=1), both) == pytest.approx({"r0": 2.0, "r1": 2.0}, abs=1e-6)


def test_speed_changes_mid_prefill_are_accounted_for() -> None:
    # On one core: r0 computes alone for 0.5 s (half its work), then shares with r1 until it
    # ends at 1.5 s; r1 did 0.5 s of work by then and finishes its other 0.5 s alone at 2.0 s.
    reqs = [request(0, 0.0, 1000, 1), request(1, 0.5, 1000, 1)]
    assert ttfts(Colocation(cores=1), reqs) == pytest.approx({"r0": 1.5, "r1": 1.5}, abs=1e-6)


def test_a_decoding_batch_slows_a_prefill_on_the_same_core() -> None:
    # r0 (16 tokens) ends its prefill at 0.016 s and then decodes 200 steps of 10 ms: 2 s of work.
    # r1 arrives at 0.5 s on the other prefill instance and shares the core with the decode batch.
    reqs = [request(0, 0.0, 16, 201), request(1, 0.5, 500, 1)]
    own = ttfts(None, reqs)
    shared = ttfts(Colocation(cores=1), reqs)
    assert own["r1"] == pytest.approx(0.5, abs=0.011)  # (the decode reservation waits for a step boundary)
    assert shared["r1"] == pytest.approx(1.0, abs=0.011)


def test_calibration_colocates_instances_of_one_machine() -> None:
    est = {"prefill_1k_tokens_s": 0.5, "decode_step_batch_8_s": 0.046}
    one_machine = [{"role": "prefill", "name": "box", "cpus": 2, "threads": 1},
                   {"role": "prefill", "name": "box", "cpus": 2, "threads": 1},
                   {"role": "decode", "name": "box", "cpus": 2, "threads": 1},
                   {"role": "store", "name": "box"}]
    hw = calibrated_hardware({"estimates": est, "nodes": one_machine}, block_tokens=16)
    assert hw.colocation == Colocation(cores=2, threads=1)
    two_machines = [dict(n, name=f"box{i}") for i, n in enumerate(one_machine)]
    assert calibrated_hardware({"estimates": est, "nodes": two_machines}, 16).colocation is None
    unreported = [{k: v for k, v in n.items() if k != "cpus"} for n in one_machine]
    assert calibrated_hardware({"estimates": est, "nodes": unreported}, 16).colocation is None
    # Nodes of different names on one machine (two prefill nodes of a dev cluster) share it;
    # one machine id apart is another machine, whatever the names say.
    named_apart = [dict(n, name=f"node{i}", machine="boot-1") for i, n in enumerate(one_machine)]
    assert calibrated_hardware({"estimates": est, "nodes": named_apart}, 16).colocation == Colocation(2, 1)
    named_apart[1]["machine"] = "boot-2"
    assert calibrated_hardware({"estimates": est, "nodes": named_apart}, 16).colocation is None
