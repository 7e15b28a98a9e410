"""The conductor's cost models: what prefill and decode cost on this cluster's machines.

Each starts from the start-up profile of the first instance of its role to register (the
machine's own numbers; the built-in prior until then) and follows what instances report:
prefill times with each first token, decode step times with each heartbeat. Admission
only refuses on a prediction with ``evidence`` behind it: a profile or measurements.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mooncake.metrics import Metrics
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.engine_profile import EngineProfile

if TYPE_CHECKING:
    from mooncake.conductor.request import Attempt

log = logging.getLogger(__name__)


class CostModels:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.prefill = PrefillCostModel()
        self.decode = DecodeCostModel()
        self.profiled: set[str] = set()  # roles whose start-up profile seeded their model

    def seed(self, role: str, profile: EngineProfile) -> bool:
        """Start ``role``'s model from its first instance's profile; True if it did."""
        if role in self.profiled:
            return False
        if role == "prefill" and profile.prefill:
            seeded = PrefillCostModel.from_profile(profile.prefill, chunk_tokens=profile.chunk_tokens)
            seeded.dispatch, seeded.transit = self.prefill.dispatch, self.prefill.transit
            self.prefill = seeded
        elif role == "decode" and profile.decode:
            self.decode = DecodeCostModel.from_profile(profile.decode)
        else:
            return False
        self.profiled.add(role)
        log.info("%s cost model seeded from a start-up profile (%.1fs of measurements)", role, profile.seconds)
        return True

    def observe_prefill(self, computed: int, cached: int, prefill_s: float, fetched: int, fetch_s: float) -> None:
        self.prefill.observe(computed, cached, prefill_s)
        self.prefill.observe_fetch(fetched, fetch_s)
        self.metrics.cost_model_rejected_fits.labels("prefill").set(self.prefill.model.rejected_fits)

    def observe_dispatch(self, attempt: Attempt, prefilled_at: float, worked_s: float) -> None:
        """What an attempt spent beyond its prefill's work (``worked_s``: fetch + compute), when
        its plan predicted no queue and no wait for decode memory (else queueing would count)."""
        plan = attempt.plan
        if plan.queue_s > 0 or plan.reserve_wait_s > 0 or not attempt.reserved_at:
            return
        self.prefill.dispatch.observe(prefilled_at - attempt.started - worked_s)
        self.prefill.transit.observe(prefilled_at - attempt.reserved_at - worked_s)

    def observe_decode(self, steps: list[tuple[int, int, float]]) -> None:
        for batch, kv_tokens, seconds in steps:
            self.decode.observe(int(batch), int(kv_tokens), float(seconds))
        self.metrics.cost_model_rejected_fits.labels("decode").set(self.decode.model.rejected_fits)

    def evidence(self) -> tuple[bool, bool]:
        """Whether the (prefill, decode) models rest on measurements of this machine."""
        return ("prefill" in self.profiled or self.prefill.model.samples > 0,
                "decode" in self.profiled or self.decode.model.samples > 0)
