"""Admission: every reason a request is refused, decided once, before any compute.

A refusal is a typed ``Rejection`` (HTTP status, reason, message, the request
field at fault, when to retry); the HTTP layer maps it to OpenAI's error body.
``check_request`` judges the request against the model and the cluster's caps,
``check_plan`` the scheduler's predictions against the SLOs.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.config import ConductorConfig
from mooncake.protocol import ModelFacts, Sampling
from mooncake.sched.scheduler import Plan


@dataclass(frozen=True)
class Rejection:
    status: int  # HTTP status: 400, 413, 429, 503
    reason: str  # metric label and OpenAI error code
    message: str
    param: str | None = None  # the request field at fault
    retry_after_s: float | None = None


class Admission:
    def __init__(self, cfg: ConductorConfig) -> None:
        self.cfg = cfg

    def check_request(self, tokens: list[int], sampling: Sampling, facts: ModelFacts | None,
                      pool_blocks: int, in_flight: int, waiting: int) -> Rejection | None:
        """``pool_blocks``: the largest KV pool among the instances that would serve it."""
        if facts is None:
            return Rejection(503, "no_workers", "no worker has registered yet", retry_after_s=1)
        if not tokens:
            return Rejection(400, "invalid_prompt", "the prompt is empty", "prompt")
        limit = facts.max_model_len
        if len(tokens) >= limit:
            return Rejection(400, "context_length_exceeded",
                             f"the prompt has {len(tokens)} tokens; this model's context is {limit} tokens "
                             f"(at most {limit - 1} prompt tokens)", "prompt")
        if min(tokens) < 0 or max(tokens) >= facts.vocab_size:
            bad = min(tokens) if min(tokens) < 0 else max(tokens)
            return Rejection(400, "invalid_prompt",
                             f"prompt token id {bad} is outside the vocabulary [0, {facts.vocab_size})", "prompt")
        if sampling.max_tokens < 1:
            return Rejection(400, "invalid_value", "max_tokens must be at least 1", "max_tokens")
        need = -(-(len(tokens) + 1) // facts.block_tokens)
        if pool_blocks and need > pool_blocks:
            return Rejection(400, "context_length_exceeded",
                             f"the prompt needs {need} KV blocks; the largest instance holds {pool_blocks}", "prompt")
        if in_flight >= self.cfg.max_requests:
            return Rejection(503, "overloaded", f"{in_flight} requests in flight; try again later", retry_after_s=1)
        if waiting >= self.cfg.max_waiting:
            return Rejection(503, "overloaded", f"{waiting} requests are queued; try again later", retry_after_s=1)
        return None

    def check_plan(self, plan: Plan | None) -> Rejection | None:
        if plan is None:
            return Rejection(503, "no_workers", "no prefill or decode instance is available", retry_after_s=1)
        cfg = self.cfg
        if cfg.ttft_slo_ms and plan.best_ttft_s * 1000 > cfg.ttft_slo_ms:
            return Rejection(429, "ttft_slo", f"predicted time to first token {plan.best_ttft_s * 1000:.0f} ms "
                             f"exceeds the {cfg.ttft_slo_ms:.0f} ms SLO", retry_after_s=max(1.0, plan.best_ttft_s))
        if cfg.tbt_slo_ms and plan.est_tbt_s * 1000 > cfg.tbt_slo_ms:
            return Rejection(429, "tbt_slo", f"predicted time between tokens {plan.est_tbt_s * 1000:.0f} ms at batch "
                             f"{plan.decode_batch} exceeds the {cfg.tbt_slo_ms:.0f} ms SLO", retry_after_s=1.0)
        return None
