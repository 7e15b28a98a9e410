"""What a simulation measured: per-request outcomes and the summary the CLI reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np

from mooncake.sim.workload import SimRequest

if TYPE_CHECKING:
    from mooncake.sim.instances import PrefillInstance
    from mooncake.sim.setup import SimSetup


class Outcome:
    __slots__ = ("req", "rejected", "started_s", "first_token_s", "decode_joined_s", "finished_s",
                 "device_blocks", "reused_blocks", "written_blocks")

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.rejected: str | None = None
        self.started_s = self.first_token_s = self.decode_joined_s = self.finished_s = -1.0
        self.device_blocks = self.reused_blocks = self.written_blocks = 0  # written: to a store

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.req.arrival_s

    @property
    def tbt_s(self) -> float:
        """Mean time between this request's tokens (0 for a one-token answer)."""
        n = self.req.output_tokens - 1
        return (self.finished_s - self.first_token_s) / n if n > 0 else 0.0


@dataclass
class SimResult:
    policy: str
    use_store: bool
    prefill: int
    decode: int
    colocated: int
    step_tokens: int  # a colocated instance's tokens per step (0: none in the cluster)
    profile: str
    requests: int
    completed: int
    rejected: int
    rejected_by_reason: dict[str, int]
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    queue_mean_s: float
    tbt_mean_s: float
    tbt_p90_s: float
    tbt_p99_s: float
    ttft_slo_ms: float
    tbt_slo_ms: float
    slo_attainment: float
    goodput_rps: float
    cache_hit_rate: float  # prompt tokens reused (device + store) / prompt tokens, served requests
    device_hit_rate: float
    prefill_utilization: float
    store_write_share: float  # blocks written to the stores / prompt blocks computed, served requests
    sim_duration_s: float
    sim_wall_s: float
    # per request class, where the trace has more than one: attainment (interactive classes
    # against both SLOs, flex work only against completion), TTFT, output tokens served
    by_class: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def _weighted_pct(gaps: list[tuple[float, float]], q: float) -> float:
    if not gaps:
        return 0.0
    arr = np.asarray(gaps)
    order = np.argsort(arr[:, 0])
    values, weights = arr[order, 0], np.cumsum(arr[order, 1])
    return float(values[min(len(values) - 1, np.searchsorted(weights, q / 100 * weights[-1]))])


def _met(ttft: np.ndarray, tbt: np.ndarray, ttft_slo_ms: float, tbt_slo_ms: float) -> np.ndarray:
    """Which served requests met both SLOs (an SLO of 0: none)."""
    ok = np.ones(len(ttft), bool)
    if ttft_slo_ms:
        ok &= ttft * 1000 <= ttft_slo_ms
    if tbt_slo_ms:
        ok &= tbt * 1000 <= tbt_slo_ms
    return ok


def summarize(setup: SimSetup, profile: str, requests: list[SimRequest], outcomes: dict[str, Outcome],
              gaps: list[tuple[float, float]], end_s: float, wall_s: float,
              prefills: Iterable[PrefillInstance], block_tokens: int, step_tokens: int = 0) -> SimResult:
    served = [o for o in outcomes.values() if o.rejected is None and o.finished_s >= 0]
    reasons: dict[str, int] = {}
    for o in outcomes.values():
        if o.rejected is not None:
            reasons[o.rejected] = reasons.get(o.rejected, 0) + 1
    ttft = np.fromiter((o.ttft_s for o in served), float, len(served))
    tbt = np.fromiter((o.tbt_s for o in served), float, len(served))
    queue = np.fromiter((o.started_s - o.req.arrival_s for o in served), float, len(served))
    met = int(_met(ttft, tbt, setup.ttft_slo_ms, setup.tbt_slo_ms).sum())
    n = len(requests)
    span = (max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)) if requests else 0.0
    span = span if span > 0 else max(end_s, 1e-9)
    prompt = sum(o.req.prompt_tokens for o in served)
    reused = sum(o.reused_blocks for o in served) * block_tokens
    device = sum(o.device_blocks for o in served) * block_tokens
    computed = sum(len(o.req.hashes) - o.reused_blocks for o in served)
    prefills = list(prefills)
    busy = sum(p.busy_s for p in prefills) / max(1e-9, end_s * len(prefills))
    gap_mean = (sum(g * c for g, c in gaps) / sum(c for _, c in gaps)) if gaps else 0.0
    return SimResult(
        policy=setup.policy, use_store=setup.use_store, prefill=setup.prefill, decode=setup.decode,
        colocated=setup.colocated, step_tokens=step_tokens, profile=profile,
        requests=n, completed=len(served), rejected=n - len(served), rejected_by_reason=reasons,
        ttft_mean_s=float(ttft.mean()) if ttft.size else 0.0, ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99), queue_mean_s=float(queue.mean()) if queue.size else 0.0,
        tbt_mean_s=gap_mean, tbt_p90_s=_weighted_pct(gaps, 90), tbt_p99_s=_weighted_pct(gaps, 99),
        ttft_slo_ms=setup.ttft_slo_ms, tbt_slo_ms=setup.tbt_slo_ms,
        slo_attainment=met / n if n else 0.0, goodput_rps=met / span,
        cache_hit_rate=reused / prompt if prompt else 0.0, device_hit_rate=device / prompt if prompt else 0.0,
        prefill_utilization=min(1.0, busy), sim_duration_s=end_s, sim_wall_s=wall_s,
        store_write_share=sum(o.written_blocks for o in served) / max(1, computed),
        by_class=_by_class(setup, outcomes.values(), span))


def _by_class(setup: SimSetup, outcomes: Iterable[Outcome], span: float) -> dict[str, dict]:
    """Each class's requests: served, attainment (flex: served at all), TTFT, the output tokens
    served and when the last of them was.
    The class is the request's own, also where the run serves every request as default."""
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.req.request_class, []).append(o)
    if set(groups) <= {"default"}:
        return {}
    out = {}
    for cls_name, outs in sorted(groups.items()):
        served = [o for o in outs if o.rejected is None and o.finished_s >= 0]
        ttft = np.fromiter((o.ttft_s for o in served), float, len(served))
        tbt = np.fromiter((o.tbt_s for o in served), float, len(served))
        met = int(_met(ttft, tbt, setup.ttft_slo_ms, setup.tbt_slo_ms).sum()) if cls_name != "flex" else len(served)
        out[cls_name] = {"requests": len(outs), "completed": len(served), "slo_attainment": met / len(outs),
                     "goodput_rps": met / span, "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
                     "tbt_p90_s": _pct(tbt, 90), "output_tokens": sum(o.req.output_tokens for o in served),
                     "last_finished_s": max((o.finished_s for o in served), default=0.0)}
    return out
