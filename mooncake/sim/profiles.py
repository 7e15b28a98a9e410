"""Built-in analytic hardware profiles: model dimensions x accelerator roofline.

Prefill is compute-bound: ``2 * params`` FLOPs per token plus attention's
``4 * layers * hidden`` per (token, context token) pair, at a model FLOPs
utilisation; each chunk costs at least one read of the weights. Decode is
memory-bound: each step reads the weights once and every sequence's KV. A colocated
instance's step is one packed forward of both, as an accelerator engine runs it (Sarathi-Serve,
vLLM's chunked prefill), so it takes the longer of the two bounds, not their sum: decode rows
ride along a compute-bound chunk almost for free, and a small chunk along a memory-bound
decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mooncake.sim.hardware import Capacities, Hardware

GB = 1e9
TB = 1e12
ENGINE_BLOCK_TOKENS = 16  # [engine] block_tokens: the blocks a codec scales per channel


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    params: float  # model parameters
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    gpus: int  # accelerators per instance (tensor parallel)
    peak_flops: float  # per accelerator, dense, at dtype
    hbm_bw: float  # bytes/s per accelerator
    hbm_bytes: float  # per accelerator
    prefill_mfu: float
    decode_mbu: float
    step_overhead_s: float  # per prefill chunk and per decode step (launches, sync, sampling)
    prefill_chunk_tokens: int
    local_bw: float  # bytes/s, host DRAM -> this instance's accelerators
    network_bw: float  # bytes/s per machine (RDMA)
    lmdb_bw: float  # bytes/s per machine: the store's LMDB tier (its SSD)
    dram_bytes: float  # store DRAM per machine given to the KV pool
    lmdb_bytes: float  # store SSD per machine given to the KV pool (the LMDB tier)
    prefill_cache_fraction: float  # of the HBM left after weights, kept as prefix cache
    decode_max_batch: int


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("a800x8-llama2-70b", "Llama-2-70B (GQA, 8 KV heads) on a node of 8 A800-80GB, TP 8, "
            "8x200 Gbps RDMA (the Mooncake paper's setting)",
            params=69e9, layers=80, hidden=8192, kv_heads=8, head_dim=128, dtype_bytes=2,
            gpus=8, peak_flops=312e12, hbm_bw=2.0 * TB, hbm_bytes=80 * GB, prefill_mfu=0.45, decode_mbu=0.6,
            step_overhead_s=0.01, prefill_chunk_tokens=8192, local_bw=8 * 20 * GB, network_bw=8 * 25 * GB,
            lmdb_bw=8 * GB, dram_bytes=1.5 * TB, lmdb_bytes=12 * TB, prefill_cache_fraction=0.5, decode_max_batch=256),
    Profile("h100x8-llama3-70b", "Llama-3-70B on a node of 8 H100-80GB SXM, TP 8, 8x400 Gbps RDMA",
            params=70.6e9, layers=80, hidden=8192, kv_heads=8, head_dim=128, dtype_bytes=2,
            gpus=8, peak_flops=989e12, hbm_bw=3.35 * TB, hbm_bytes=80 * GB, prefill_mfu=0.4, decode_mbu=0.6,
            step_overhead_s=0.008, prefill_chunk_tokens=8192, local_bw=8 * 40 * GB, network_bw=8 * 50 * GB,
            lmdb_bw=12 * GB, dram_bytes=1.5 * TB, lmdb_bytes=24 * TB, prefill_cache_fraction=0.5, decode_max_batch=256),
    Profile("l4-llama3-8b", "Llama-3-8B on one L4-24GB, 25 Gbps Ethernet",
            params=8.0e9, layers=32, hidden=4096, kv_heads=8, head_dim=128, dtype_bytes=2,
            gpus=1, peak_flops=121e12, hbm_bw=0.3 * TB, hbm_bytes=24 * GB, prefill_mfu=0.5, decode_mbu=0.6,
            step_overhead_s=0.005, prefill_chunk_tokens=2048, local_bw=20 * GB, network_bw=3 * GB,
            lmdb_bw=2 * GB, dram_bytes=64 * GB, lmdb_bytes=1 * TB, prefill_cache_fraction=0.5, decode_max_batch=64),
)}


class AnalyticHardware(Hardware):
    """``kv_codec`` ([model] kv_codec): what a block costs outside the pool, on links and in the
    store tiers (the pool and decode's KV stay in the serving dtype)."""

    def __init__(self, profile: Profile, block_tokens: int, kv_codec: str = "none") -> None:
        p = self.profile = profile
        self.name = p.name + ("" if kv_codec == "none" else f"+kv_{kv_codec}")
        self.block_tokens = block_tokens
        self.chunk_tokens = p.prefill_chunk_tokens
        self.kv_bytes_per_token = 2 * p.layers * p.kv_heads * p.head_dim * p.dtype_bytes
        self.wire_bytes_per_token = self.kv_bytes_per_token * encoded_share(kv_codec, p.dtype_bytes)
        self.block_bytes = self.kv_bytes_per_token * block_tokens
        wire_block = self.wire_bytes_per_token * block_tokens
        self.weight_bytes = p.params * p.dtype_bytes
        self._flops = p.gpus * p.peak_flops * p.prefill_mfu
        self._weights_read_s = self.weight_bytes / (p.gpus * p.hbm_bw)
        self._decode_bw = p.gpus * p.hbm_bw * p.decode_mbu
        free_hbm = max(0.0, p.gpus * p.hbm_bytes * 0.9 - self.weight_bytes)
        cache_bytes = free_hbm * p.prefill_cache_fraction  # a colocated instance runs its requests in the rest
        self.caps = Capacities(
            prefill_cache_blocks=int(cache_bytes // self.block_bytes),
            decode_kv_tokens=int(free_hbm // self.kv_bytes_per_token),
            decode_max_batch=p.decode_max_batch,
            colocated_kv_tokens=int((free_hbm - cache_bytes) // self.kv_bytes_per_token),
            store_dram_blocks=int(p.dram_bytes // wire_block),
            store_lmdb_blocks=int(p.lmdb_bytes // wire_block))

    def _chunk_s(self, n: int, ctx: int) -> float:
        p = self.profile
        flops = 2 * p.params * n + 4 * p.layers * p.hidden * n * (ctx + n / 2)
        return max(flops / self._flops, self._weights_read_s) + p.step_overhead_s

    def prefill_s(self, n_new: int, ctx: int) -> float:
        chunk = self.profile.prefill_chunk_tokens
        total = 0.0
        done = 0
        while True:
            n = min(chunk, n_new - done)
            total += self._chunk_s(n, ctx + done)
            done += n
            if done >= n_new:
                return total

    def decode_step_s(self, batch: int, ctx_tokens: float) -> float:
        p = self.profile
        memory = (self.weight_bytes + ctx_tokens * self.kv_bytes_per_token) / self._decode_bw
        compute = (2 * p.params * batch + 4 * p.layers * p.hidden * ctx_tokens) / self._flops
        return max(memory, compute) + p.step_overhead_s

    def mixed_step_s(self, batch: int, ctx_tokens: float, chunks: Sequence[tuple[int, int]]) -> float:
        """The roofline of the whole forward: the decode rows' and the chunks' FLOPs against the
        batch's weight and KV reads (a lone prompt's chunk: its prefill, as ``prefill_s``)."""
        if not chunks:
            return self.decode_step_s(batch, ctx_tokens)
        p = self.profile
        pairs = ctx_tokens + sum(n * (ctx + n / 2) for n, ctx in chunks)  # (query, key) pairs of attention
        flops = 2 * p.params * (batch + sum(n for n, _ in chunks)) + 4 * p.layers * p.hidden * pairs
        memory = (self.weight_bytes + ctx_tokens * self.kv_bytes_per_token) / self._decode_bw if batch \
            else self._weights_read_s
        return max(flops / self._flops, memory) + p.step_overhead_s

    def fetch_block_s(self, tier: str, local: bool) -> float:
        p = self.profile
        bw = p.local_bw if local else min(p.local_bw, p.network_bw)
        if tier == "lmdb":
            bw = min(bw, p.lmdb_bw)
        return self.wire_bytes_per_token * self.block_tokens / bw

    def kv_transfer_s(self, tokens: int) -> float:
        return tokens * self.wire_bytes_per_token / self.profile.network_bw

    def transit_s(self) -> float:
        """The roofline leaves the messages between roles out."""
        return 0.0

    def kv_handoff_s(self, tokens: int, compute_s: float) -> float:
        """Layer-wise: each layer's KV leaves as soon as it is computed, so only what the
        link has not caught up with by the end of prefill (at least the last layer) remains."""
        t = self.kv_transfer_s(tokens)
        return max(t - compute_s, t / self.profile.layers)


def encoded_share(kv_codec: str, dtype_bytes: int) -> float:
    """Bytes of KV outside the pool per byte inside it: int8 and fp8 store one byte per value and a
    float16 scale per channel of each 16-token engine block (``mooncake/kv/codec.py``)."""
    if kv_codec == "none":
        return 1.0
    if kv_codec not in ("int8", "fp8"):
        raise ValueError(f"unknown kv_codec {kv_codec!r}")
    return (1 + 2 / ENGINE_BLOCK_TOKENS) / dtype_bytes


def hardware_for(name: str, block_tokens: int, kv_codec: str = "none") -> Hardware:
    try:
        return AnalyticHardware(PROFILES[name], block_tokens, kv_codec)
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; built-in: {', '.join(sorted(PROFILES))}") from None
