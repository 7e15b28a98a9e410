"""What the simulator's virtual instances cost: prefill and decode time, KV movement
time by tier and link, and capacities. Two sources: an analytic profile (model
dimensions x accelerator roofline, ``profiles.py``) or the fitted cost models of a
running cluster (``calibrate.py``). Both give a ``Hardware``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from mooncake.sched.ttft_estimate import FetchCosts
from mooncake.sim.shared_cpu import Colocation

STORE_TIERS = ("dram", "lmdb")  # a simulated store's tiers


@dataclass(frozen=True)
class Capacities:
    prefill_cache_blocks: int  # device prefix cache of a prefill instance
    decode_kv_tokens: int  # KV a decode instance holds for its running batch
    decode_max_batch: int
    colocated_kv_tokens: int  # KV a colocated instance holds for its requests (its prefix cache: prefill_cache_blocks)
    store_dram_blocks: int  # per store (one store per prefill machine)
    store_lmdb_blocks: int  # per store: its LMDB tier (on SSD)


class Hardware(ABC):
    """Costs in seconds of one instance of a cluster, at a given ``block_tokens``."""

    name: str
    block_tokens: int
    kv_bytes_per_token: float
    caps: Capacities
    chunk_tokens: int  # prompt tokens per prefill forward
    colocation: Colocation | None = None  # None: every instance has hardware of its own
    step_tokens: int = 0  # a colocated instance's tokens per step, as a live cluster runs it (0: not known)

    @abstractmethod
    def prefill_s(self, n_new: int, ctx: int) -> float:
        """Compute time of ``n_new`` prompt tokens after ``ctx`` cached ones (chunked)."""
        raise NotImplementedError

    @abstractmethod
    def decode_step_s(self, batch: int, ctx_tokens: float) -> float:
        """One decode step over ``batch`` sequences holding ``ctx_tokens`` KV in total."""
        raise NotImplementedError

    @abstractmethod
    def fetch_block_s(self, tier: str, local: bool) -> float:
        """Reading one block into a prefill instance from a store tier ("dram"/"lmdb"),
        on the same machine (``local``) or across the network."""
        raise NotImplementedError

    def fetch_costs(self) -> FetchCosts:
        """The scheduler's per-tier fetch costs: each store tier's local read relative to DRAM's
        (the figure its prefill cost model starts from)."""
        dram = self.fetch_block_s("dram", True)
        return FetchCosts({t: self.fetch_block_s(t, True) / dram if dram > 0 else 1.0 for t in STORE_TIERS})

    @abstractmethod
    def kv_transfer_s(self, tokens: int) -> float:
        """Shipping a prompt's KV from prefill to decode over the network."""
        raise NotImplementedError

    @abstractmethod
    def mixed_step_s(self, batch: int, ctx_tokens: float, chunks: Sequence[tuple[int, int]]) -> float:
        """A colocated instance's step: a decode step of ``batch`` sequences (``ctx_tokens`` KV in
        all) and prompt chunks, each ``(tokens, cached context)``."""
        raise NotImplementedError

    @abstractmethod
    def kv_handoff_s(self, tokens: int, compute_s: float) -> float:
        """From the end of prefill (``compute_s`` of it) until decode holds the whole KV."""
        raise NotImplementedError

    @abstractmethod
    def transit_s(self) -> float:
        """Per request, messages between the roles beyond the work itself (0: negligible)."""
        raise NotImplementedError

    # Priors for the scheduler's cost models (they then learn from what the simulation observes).
    def prefill_prior(self) -> tuple[float, float]:
        """(tokens_per_s, fixed_s) of the prefill cost model."""
        fixed = self.prefill_s(1, 0)
        n = 4096
        return n / max(1e-12, self.prefill_s(n, 0) - fixed), fixed

    def decode_prior(self, typical_ctx: int = 8192) -> tuple[float, float, float]:
        """(step_s, per_seq_s, per_1k_kv_s) of the decode cost model, from the differences of
        steps around a typical context length."""
        one = self.decode_step_s(1, typical_ctx)
        per_kv = max(0.0, (self.decode_step_s(1, 2 * typical_ctx) - one) / typical_ctx)
        per_seq = max(0.0, (self.decode_step_s(9, 9 * typical_ctx) - one) / 8 - per_kv * typical_ctx)
        return max(0.0, one - per_seq - per_kv * typical_ctx), per_seq, per_kv * 1000


@dataclass(frozen=True)
class LinearCosts:
    """Plain linear costs (what a fitted cluster reports)."""

    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_pair_s: float  # attention: per (new token, context token) pair
    decode_step_s: float
    decode_per_seq_s: float
    fetch_block_s: float
    transfer_token_s: float
    transit_s: float = 0.0  # per request: messages between the roles
    decode_per_kv_token_s: float = 0.0  # per token of KV the decode batch holds


class FittedHardware(Hardware):
    def __init__(self, name: str, block_tokens: int, costs: LinearCosts, caps: Capacities,
                 kv_bytes_per_token: float = 0.0, chunk_tokens: int = 512,
                 colocation: Colocation | None = None, step_tokens: int = 0) -> None:
        self.name = name
        self.block_tokens = block_tokens
        self.costs = costs
        self.caps = caps
        self.kv_bytes_per_token = kv_bytes_per_token
        self.chunk_tokens = chunk_tokens
        self.colocation = colocation
        self.step_tokens = step_tokens

    def prefill_s(self, n_new: int, ctx: int) -> float:
        c = self.costs
        chunks = max(1, -(-n_new // self.chunk_tokens))
        return chunks * c.prefill_fixed_s + n_new * c.prefill_per_token_s + n_new * (ctx + n_new / 2) * c.prefill_per_pair_s

    def decode_step_s(self, batch: int, ctx_tokens: float) -> float:
        c = self.costs
        return c.decode_step_s + batch * c.decode_per_seq_s + ctx_tokens * c.decode_per_kv_token_s

    def fetch_block_s(self, tier: str, local: bool) -> float:
        return self.costs.fetch_block_s

    def kv_transfer_s(self, tokens: int) -> float:
        return tokens * self.costs.transfer_token_s

    def mixed_step_s(self, batch: int, ctx_tokens: float, chunks: Sequence[tuple[int, int]]) -> float:
        """As the live role runs it (``roles/colocated.py``): the decode forward, then the chunks'
        forward (each chunk costing what it would alone)."""
        decode = self.decode_step_s(batch, ctx_tokens) if batch else 0.0
        return decode + sum(self.prefill_s(n, ctx) for n, ctx in chunks)

    def kv_handoff_s(self, tokens: int, compute_s: float) -> float:
        """The whole transfer after prefill (what a fitted cluster measured does not overlap it)."""
        return self.kv_transfer_s(tokens)

    def transit_s(self) -> float:
        return self.costs.transit_s

    def prefill_prior(self) -> tuple[float, float]:
        return 1.0 / max(1e-12, self.costs.prefill_per_token_s), self.costs.prefill_fixed_s

    def decode_prior(self, typical_ctx: int = 8192) -> tuple[float, float, float]:
        c = self.costs
        return c.decode_step_s, c.decode_per_seq_s, c.decode_per_kv_token_s * 1000
