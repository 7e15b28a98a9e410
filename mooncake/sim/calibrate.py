"""``--calibrate URL``: the fitted cost models of a running cluster, from ``GET /cluster``.

Read today: ``estimates.prefill_1k_tokens_s`` and ``estimates.decode_step_batch_8_s``
(required; a step of 8 sequences of 1,024 tokens each). Read when present (a cluster that reports them is simulated more
faithfully): ``estimates.prefill_fixed_s``, ``estimates.prefill_per_token_s``,
``estimates.prefill_per_pair_s`` (attention, per new-token x context-token pair),
``estimates.decode_step_s``, ``estimates.decode_per_seq_s``, ``estimates.decode_per_kv_token_s``
(per token of KV the batch holds), ``estimates.fetch_block_s``
(per store block read), ``estimates.kv_transfer_token_s``, ``estimates.transit_s`` (per
request, messages between the roles), ``block_tokens`` (the engines'
block size: block counts and ``fetch_block_s`` are converted to the simulation's blocks) and,
per node, ``num_blocks`` / ``kv_block_bytes`` (else ``block_bytes``: a stored block, engine),
``step_tokens`` (colocated) and ``load.tiers.<tier>.capacity_bytes`` (store).
When all engine nodes share one ``machine`` and report ``cpus`` (and ``threads``), the
simulated instances share that many cores as the live ones do (``shared_cpu.py``).

Engine nodes are prefill, decode and colocated ones alike: a cluster of colocated instances
alone calibrates too. Its cost models are the cluster's (the conductor seeds both from a
colocated instance's start-up profile and follows its plain decode steps and prompts), and a
simulated colocated instance runs the ``step_tokens`` the live ones report.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any

from mooncake.protocol import ENGINE_ROLES
from mooncake.sim.hardware import Capacities, FittedHardware, LinearCosts
from mooncake.sim.shared_cpu import Colocation

# With only the batch-8 step time, the batch dependence takes the shape of the default decode
# prior (0.03 s + 0.002 s per sequence): 0.016 / 0.046 of the batch-8 step is per sequence.
_PER_SEQ_SHARE_AT_8 = 0.016 / 0.046
_UNBOUNDED = 1 << 40


class CalibrationError(ValueError):
    """The cluster could not be read, or its answer lacks the cost figures."""


def fetch_cluster(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/cluster", headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        hint = " (give --api-key)" if e.code in (401, 403) else ""
        raise CalibrationError(f"GET {req.full_url}: HTTP {e.code}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        raise CalibrationError(f"GET {req.full_url}: {getattr(e, 'reason', e)}") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise CalibrationError(f"GET {req.full_url}: the answer is not JSON") from None
    if not isinstance(data, dict):
        raise CalibrationError(f"GET {req.full_url}: expected a JSON object")
    return data


def _number(obj: Any, key: str, required: bool = False) -> float | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        if required:
            raise CalibrationError(f"/cluster has no usable estimates.{key} (got {value!r})")
        return None
    return float(value)


def _capacities(nodes: list, default_batch: int, ratio: float) -> Capacities:
    """``ratio``: engine block tokens / simulated block tokens."""
    engines = _engines(nodes)
    stores = [n for n in nodes if isinstance(n, dict) and n.get("role") == "store"]
    # a stored block's bytes: encoded by [model] kv_codec (kv_block_bytes), else the pool's
    block_bytes = next((b for n in engines if (b := _number(n, "kv_block_bytes") or _number(n, "block_bytes"))), None)

    def blocks(*roles: str) -> int:
        found = [int(b) for n in engines if n.get("role") in roles and (b := _number(n, "num_blocks"))]
        return int(min(found) * ratio) if found else _UNBOUNDED

    def tier_blocks(*tiers: str) -> int:
        if not block_bytes or not stores:
            return _UNBOUNDED
        caps = []
        for s in stores:
            t = (s.get("load") or {}).get("tiers") or {}
            caps.append(sum(_number(t.get(k), "capacity_bytes") or 0 for k in tiers))
        return int(min(caps) / block_bytes * ratio)

    return Capacities(prefill_cache_blocks=blocks("prefill", "colocated"), decode_kv_tokens=_UNBOUNDED,
                      decode_max_batch=default_batch, colocated_kv_tokens=_UNBOUNDED, store_dram_blocks=tier_blocks("device", "dram"),
                      store_lmdb_blocks=tier_blocks("lmdb"))


def _colocation(nodes: list) -> Colocation | None:
    """The machine the engine nodes share, when they all run on one (a dev cluster): same
    ``machine`` (or, from a cluster that does not report it, same node ``name``)."""
    engines = _engines(nodes)
    if len(engines) < 2 or len({n.get("machine") or n.get("name") for n in engines}) != 1:
        return None
    cpus = min((_number(n, "cpus") or 0 for n in engines), default=0)
    if not cpus:
        return None
    threads = max(_number(n, "threads") or 1 for n in engines)
    return Colocation(cores=cpus, threads=threads)


def _engines(nodes: list) -> list[dict]:
    return [n for n in nodes if isinstance(n, dict) and n.get("role") in ENGINE_ROLES]


def _step_tokens(nodes: list) -> int:
    """The colocated instances' tokens per step (the smallest, where they differ; 0: none reported)."""
    found = [int(t) for n in _engines(nodes) if n.get("role") == "colocated" and (t := _number(n, "step_tokens"))]
    return min(found, default=0)


def calibrated_hardware(cluster: dict, block_tokens: int, name: str = "calibrated",
                        decode_max_batch: int = 32) -> FittedHardware:
    """Simulated instances that cost what the cluster's own cost models predict."""
    est = cluster.get("estimates")
    if not isinstance(est, dict):
        raise CalibrationError("/cluster has no 'estimates' object (is this a mooncake conductor?)")
    p1k = _number(est, "prefill_1k_tokens_s", required=True)
    d8 = _number(est, "decode_step_batch_8_s", required=True)
    fixed = _number(est, "prefill_fixed_s") or 0.0
    per_token = _number(est, "prefill_per_token_s")
    if per_token is None:
        per_token = max(0.0, p1k - fixed) / 1000
    per_seq = _number(est, "decode_per_seq_s")
    step = _number(est, "decode_step_s")
    if per_seq is None or step is None:
        per_seq = d8 * _PER_SEQ_SHARE_AT_8 / 8
        step = d8 - 8 * per_seq
    engine_block = _number(cluster, "block_tokens") or block_tokens
    ratio = engine_block / block_tokens
    costs = LinearCosts(prefill_fixed_s=fixed, prefill_per_token_s=per_token,
                        prefill_per_pair_s=_number(est, "prefill_per_pair_s") or 0.0,
                        decode_step_s=step, decode_per_seq_s=per_seq,
                        decode_per_kv_token_s=_number(est, "decode_per_kv_token_s") or 0.0,
                        fetch_block_s=(_number(est, "fetch_block_s") or 0.0) / ratio,
                        transfer_token_s=_number(est, "kv_transfer_token_s") or 0.0,
                        transit_s=_number(est, "transit_s") or 0.0)
    nodes = cluster.get("nodes")
    nodes = nodes if isinstance(nodes, list) else []
    return FittedHardware(name, block_tokens, costs, _capacities(nodes, decode_max_batch, ratio),
                          colocation=_colocation(nodes), step_tokens=_step_tokens(nodes))
