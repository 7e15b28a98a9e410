"""A simulated colocated instance: prefill and decode in one engine (``roles/colocated.py``).

Requests wait in class order for KV room: the whole request's (prompt and output) is reserved
before its prompt runs, as the live role reserves before it prefills, and at most
``MAX_PROMPTS`` prompts hold room before they are computed. A reserved prompt reuses its cached
prefix as a prefill instance does (device cache, then the plan's store reads), then computes in
chunks. Each step (``Hardware.mixed_step_s``) is a token for every decoding sequence and prompt
chunks within ``step_tokens`` tokens in all, the prompts in reservation order, each moving at
least an engine block (Sarathi-Serve's stall-free batching); with nothing decoding, prompts take
whole ``chunk_tokens`` chunks. A prompt's sequence decodes from the step after its last chunk,
in place: no KV moves. While no prompt is ready the batch advances analytically, as a decode
instance's; a prompt that becomes ready joins at the next step boundary. Not modelled: the
preemption of flex work (a flex request waits for room like any other).
"""

from __future__ import annotations

import math
from typing import Protocol

from mooncake.config import EngineConfig
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.colocated_budget import DEFAULT_TBT_TARGET_MS, TYPICAL_BATCH, TYPICAL_CTX, fit_step_tokens
from mooncake.sched.plan import Plan
from mooncake.sched.scheduler import Scheduler
from mooncake.sim.events import EventLoop
from mooncake.sim.hardware import Hardware
from mooncake.sim.instances import ColocatedInstance, DecodeSeq, Prefiller, Prompt, queue_by_rank
from mooncake.sim.results import Outcome
from mooncake.sim.workload import SimRequest


class SimulationCore(Protocol):
    """What the colocated steps use of the simulation (``simulator.Simulation``)."""

    B: int  # tokens per block
    loop: EventLoop
    hw: Hardware
    outcomes: dict[str, Outcome]
    gaps: list[tuple[float, float]]
    sched: Scheduler
    prefill_cost: PrefillCostModel
    decode_cost: DecodeCostModel

    def rank_of(self, r: SimRequest) -> int: ...
    def reuse(self, inst: Prefiller, r: SimRequest, plan: Plan) -> tuple[int, int, float]: ...
    def prefilled(self, inst: Prefiller, r: SimRequest, plan: Plan) -> None: ...
    def finish(self, req_id: str) -> None: ...
    def speed(self) -> float: ...
    def set_computing(self, node_id: str, computing: bool) -> bool: ...


# As the role: engine blocks of ``[engine] block_tokens`` (a prompt moves at least one a step); at
# most ``[engine] max_prefill_batch`` prompts hold room before they are computed (the defaults).
ENGINE_BLOCK = EngineConfig.model_fields["block_tokens"].default
MAX_PROMPTS = EngineConfig.model_fields["max_prefill_batch"].default


def step_budget(hw: Hardware, tbt_slo_ms: float) -> int:
    """Tokens per step: as a calibrated cluster's instances run them (a fixed ``[engine]
    step_tokens``), else the most whose step of ``TYPICAL_BATCH`` sequences stays within the TBT SLO
    (none set: the live role's default target, ``DEFAULT_TBT_TARGET_MS``); never more than a chunk.
    The live role sizes each step by its batch of the moment; the simulation holds the budget it
    picks at a typical batch."""
    if hw.step_tokens:
        return min(hw.step_tokens, hw.chunk_tokens)
    kv = TYPICAL_BATCH * TYPICAL_CTX
    return fit_step_tokens(lambda n: hw.mixed_step_s(TYPICAL_BATCH, kv, [(max(1, n - TYPICAL_BATCH), TYPICAL_CTX)]),
                           (tbt_slo_ms or DEFAULT_TBT_TARGET_MS) / 1000, hw.chunk_tokens, ENGINE_BLOCK)


def budget_ladder(hw: Hardware, tbt_slo_ms: float) -> list[int]:
    """The step budgets ``sim size`` tries for the colocated design, as an operator would tune
    ``[engine] step_tokens``: the live role's own pick first, then the powers of two from 64 up
    to a chunk."""
    first = step_budget(hw, tbt_slo_ms)
    return [first] + [b for b in (64 << k for k in range(16)) if b <= hw.chunk_tokens and b != first]


class ColocatedSteps:
    """The event logic of the simulation's colocated instances (the rest is ``simulator.py``'s)."""

    def __init__(self, sim: SimulationCore) -> None:
        self.sim = sim

    def enqueue(self, ci: ColocatedInstance, r: SimRequest, plan: Plan) -> None:
        queue_by_rank(ci.queue, (r, plan), lambda item: self.sim.rank_of(item[0]))
        self._reserve(ci)
        if any(p.ready for p in ci.prompts):
            self._kick(ci)

    def _reserve(self, ci: ColocatedInstance) -> None:
        """Reserve the queued requests' KV in order while it fits (an empty instance takes
        anything); each reserved prompt reads its prefix and is ready once it has."""
        sim, b = self.sim, ci.batch
        while ci.queue:
            r, plan = ci.queue[0]
            need = r.prompt_tokens + r.output_tokens
            held = len(b.active) + len(ci.prompts)
            if held and (held >= b.max_batch or b.kv_reserved + need > b.kv_capacity
                         or len(ci.prompts) >= MAX_PROMPTS):
                return
            ci.queue.popleft()
            b.kv_reserved += need
            device, reused, fetch_s = sim.reuse(ci, r, plan)
            out = sim.outcomes[r.req_id]
            out.started_s, out.device_blocks, out.reused_blocks = sim.loop.now, device, reused
            cached = reused * sim.B
            prompt = Prompt(r, plan, cached, r.prompt_tokens - cached, need)
            ci.prompts.append(prompt)
            if fetch_s > 0:
                sim.loop.after(fetch_s, self._loaded, ci, prompt)
            else:
                prompt.ready = True

    def _loaded(self, ci: ColocatedInstance, prompt: Prompt) -> None:
        prompt.ready = True
        self._kick(ci)

    def _kick(self, ci: ColocatedInstance) -> None:
        """A prompt is ready: an idle instance steps now; one running decode steps alone takes it
        at the next step boundary; one running a step with chunks at that step's end, as planned."""
        if not ci.running:
            self._next_step(ci)
        elif not ci.carrying:
            b, now = ci.batch, self.sim.loop.now
            steps = math.ceil((now - b.updated_at) / b.step_s - 1e-9)
            ci.version += 1
            self.sim.loop.at(b.updated_at + steps * b.step_s, self._boundary, ci, ci.version)

    def _boundary(self, ci: ColocatedInstance, version: int) -> None:
        """The step (or run of decode steps) under way ended: tokens, finished prompts and
        sequences, reservations, the next step."""
        if version != ci.version:
            return
        sim, b = self.sim, ci.batch
        if ci.carrying:
            self._end_mixed_step(ci)
        else:
            b.advance(sim.loop.now, sim.gaps)
        for req_id in b.retire_finished():
            sim.finish(req_id)
        self._reserve(ci)
        self._next_step(ci)

    def _end_mixed_step(self, ci: ColocatedInstance) -> None:
        sim, b, now = self.sim, ci.batch, self.sim.loop.now
        dt = now - ci.step_started
        if b.active:  # one token each; a prompt finished in this step decodes from the next
            sim.gaps.append((dt, len(b.active)))
            for s in b.active.values():
                s.remaining -= 1
                s.kv_tokens += 1
        share = dt / (len(b.active) + sum(n for _, n in ci.carrying))
        for prompt, n in ci.carrying:
            prompt.done += n
            prompt.compute_s += share * n
            if prompt.done >= prompt.n_new:
                self._prefilled(ci, prompt)
        ci.carrying = []
        b.updated_at = now

    def _prefilled(self, ci: ColocatedInstance, prompt: Prompt) -> None:
        """Its first token: the prefix cache and store writes, the booking's prefill half, the
        cost model; then it decodes in place (or, with one token to generate, is done)."""
        sim, b, r = self.sim, ci.batch, prompt.req
        ci.prompts.remove(prompt)
        out = sim.outcomes[r.req_id]
        out.first_token_s = sim.loop.now
        sim.prefilled(ci, r, prompt.plan)
        sim.sched.prefill_finished(r.req_id)
        sim.prefill_cost.observe(prompt.n_new, prompt.cached, prompt.compute_s)
        if r.output_tokens <= 1:
            b.kv_reserved -= prompt.reserved
            sim.finish(r.req_id)
            return
        b.active[r.req_id] = DecodeSeq(r.req_id, float(r.output_tokens - 1), float(r.prompt_tokens), prompt.reserved,
                                       sim.rank_of(r))
        out.decode_joined_s = sim.loop.now

    def _next_step(self, ci: ColocatedInstance) -> None:
        """Plan the next step: the batch's rows and the ready prompts' chunks within the budget."""
        sim, b, hw, now = self.sim, ci.batch, self.sim.hw, self.sim.loop.now
        rows = len(b.active)
        left = max(ENGINE_BLOCK, ci.step_tokens - rows) if rows else hw.chunk_tokens
        chunks = []
        for p in ci.prompts:
            if left <= 0:
                break
            if p.ready:
                n = min(left, p.n_new - p.done)
                chunks.append((p, n))
                left -= n
        ci.carrying, ci.running = chunks, bool(chunks or rows)
        ci.step_started = ci.work_since = b.updated_at = now
        ci.version += 1
        if not ci.running:
            b.step_s = 0.0
            sim.set_computing(ci.node.node_id, False)
            return
        kv = sum(s.kv_tokens for s in b.active.values())
        ci.own_step_s = ci.work_left = hw.mixed_step_s(rows, kv, [(n, p.cached + p.done) for p, n in chunks])
        if not sim.set_computing(ci.node.node_id, True):  # else scheduled there, at the new speed
            self.schedule(ci)

    def schedule(self, ci: ColocatedInstance) -> None:
        """The next boundary at the speed in force: the end of a step with chunks, or, with decode
        steps alone, the step in which the first sequence finishes."""
        sim, b = self.sim, ci.batch
        ci.version += 1
        speed = sim.speed()
        if ci.carrying:
            sim.loop.after(ci.work_left / speed, self._boundary, ci, ci.version)
            return
        b.step_s = ci.own_step_s / speed
        sim.decode_cost.observe(len(b.active), int(sum(s.kv_tokens for s in b.active.values())), b.step_s)
        left = min(s.remaining for s in b.active.values())
        sim.loop.after(max(0.0, left) * b.step_s, self._boundary, ci, ci.version)

    def account(self, ci: ColocatedInstance) -> None:
        """Bring the work under way up to now at the speed in force (before the speed changes)."""
        now = self.sim.loop.now
        if ci.carrying:
            ci.work_left -= (now - ci.work_since) * self.sim.speed()
            ci.work_since = now
        else:
            ci.batch.advance(now, self.sim.gaps)
