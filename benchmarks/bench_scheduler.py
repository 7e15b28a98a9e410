"""Scheduler decision latency: the real ``Scheduler.plan`` over a large cluster view.

Builds the conductor's state as it would be in a big deployment: a ``Cluster`` of
16 prefill + 16 decode instances (16 machines) and 4 stores, a ``KVIndex`` of
about 1,000,000 distinct blocks, decode instances with running requests
assigned, prefill instances with queued work. The blocks come from the Mooncake
trace: each trace hash id is expanded to 16 token ids (so equal hash ids mean
equal prefixes), chained with the same SHA-256 chain as ``mooncake.blocks``.
Each request's chain sits on the store of its session and, most of the time, in
the device cache of one prefill instance (sticky per session, as cache-aware
routing makes it), with a random device-cache eviction tail cut off.

Then the next requests of the trace are planned one by one; each
``hash_blocks`` call (the conductor hashes every prompt) and each
``scheduler.plan`` call is timed with ``time.perf_counter_ns``. The state is
not mutated by the stream, so every decision sees the same cluster load.

    .venv/bin/python benchmarks/bench_scheduler.py [--quick] [--profile] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mooncake.blocks import hash_blocks, root_hash, scheme_model_id
from mooncake.config import ConductorConfig
from mooncake.protocol import NodeInfo
from mooncake.sched.booking import DecodeSlots, PrefillQueue
from mooncake.sched.node_registry import Cluster, Node
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.kv_index import KVIndex
from mooncake.sched.plan import Plan
from mooncake.sched.scheduler import Scheduler
from mooncake.bench.publish import publish

TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl")  # ../shared beside the checkout
BLOCK = 16
MODEL_ID = "SmolLM2-135M-Instruct"
XXH3_MODEL_ID = scheme_model_id(MODEL_ID, "xxh3_128")  # the same prompts hashed with xxh3-128 (timed only)
VOCAB = 49152
N_MACHINES, N_STORES = 16, 4
TARGET_P99_US = 50.0
REPS = 3


def block_tokens_of(hid: int) -> np.ndarray:
    """The 16 token ids a trace hash id expands to (deterministic)."""
    return ((np.arange(BLOCK, dtype=np.int64) * 7919 + hid * 104729) % (VOCAB - 200) + 100).astype("<i4")


def request_tokens(hash_ids: list[int], tail: int) -> list[int]:
    toks = np.concatenate([block_tokens_of(h) for h in hash_ids]) if hash_ids else np.zeros(0, "<i4")
    return toks.tolist() + [5 + (i * 31) % 97 for i in range(tail)]


class ChainHasher:
    """Chained block hashes of trace hash-id chains, memoised per (parent, id)."""

    def __init__(self) -> None:
        self.root = root_hash(MODEL_ID)
        self.memo: dict[tuple[bytes, int], bytes] = {}

    def chain(self, hash_ids: list[int]) -> list[bytes]:
        prev, out = self.root, []
        for hid in hash_ids:
            key = (prev, hid)
            h = self.memo.get(key)
            if h is None:
                d = hashlib.sha256(prev)
                d.update(block_tokens_of(hid).tobytes())
                h = self.memo[key] = d.digest()
            out.append(h)
            prev = h
        return out


REPLICA_OFFSET = 10_000_000  # hash-id offset of each replica of the trace (a distinct tenant / prefix family)


def build(n_blocks: int, rng: random.Random, fill: list[list[int]]) -> tuple[Scheduler, KVIndex, Cluster, float, int]:
    cluster = Cluster()
    now = time.monotonic()
    for m in range(N_MACHINES):
        for role in ("prefill", "decode"):
            cluster.upsert(Node(f"m{m}-{role}", role, f"m{m}-{role}".encode(), {"kv": f"tcp://10.0.0.{m}:1"},
                                NodeInfo(f"m{m}", 1), now))
    stores = []
    for s in range(N_STORES):
        m = s * (N_MACHINES // N_STORES)
        cluster.upsert(Node(f"m{m}-store", "store", f"m{m}-store".encode(), {"store": f"tcp://10.0.0.{m}:2"},
                            NodeInfo(f"m{m}", 1), now))
        stores.append(f"m{m}-store")
    prefills = [n.node_id for n in cluster.of_role("prefill")]

    index = KVIndex()
    hasher = ChainHasher()
    t0 = time.perf_counter()
    n_req = replicas = 0
    while len(index) < n_blocks:
        replicas += 1
        for base in fill:
            ids = [h + (replicas - 1) * REPLICA_OFFSET for h in base]
            chain = hasher.chain(ids)
            session = base[0] + 7 * replicas
            index.add(stores[session % N_STORES], "dram", chain)
            if rng.random() < 0.7:  # in the device cache of its (sticky) instance, minus an evicted tail
                keep = max(1, int(len(chain) * rng.uniform(0.3, 1.0)))
                index.add(prefills[session % len(prefills)], "device", chain[:keep])
            n_req += 1
            if len(index) >= n_blocks:
                break
    fill_s = time.perf_counter() - t0

    # Load: queued prefill work, running decode requests with expected ends around now.
    sched = Scheduler(ConductorConfig(), cluster, index, PrefillCostModel(), DecodeCostModel())
    for i, p in enumerate(cluster.of_role("prefill")):
        for j in range(rng.randint(0, 6)):
            sched.queues.setdefault(p.node_id, PrefillQueue()).add(f"q{i}-{j}", rng.uniform(0.01, 0.5))
    for i, d in enumerate(cluster.of_role("decode")):
        for j in range(rng.randint(16, 48)):
            sched.slots.setdefault(d.node_id, DecodeSlots()).add(f"r{i}-{j}", now + rng.uniform(-0.5, 20.0))
    print(f"index: {len(index):,} distinct blocks from {n_req:,} requests ({replicas} replicas of the trace) "
          f"({sum(index.blocks_of(n) for n in prefills):,} device copies on {len(prefills)} prefills, "
          f"{sum(index.blocks_of(s) for s in stores):,} on {len(stores)} stores), built in {fill_s:.1f} s",
          flush=True)
    return sched, index, cluster, now, replicas


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100k blocks, 2,000 decisions")
    ap.add_argument("--blocks", type=int, help="distinct blocks in the index (default 1,000,000)")
    ap.add_argument("--requests", type=int, help="decisions to time (default 20,000)")
    ap.add_argument("--profile", action="store_true", help="cProfile the decision loop, print the top functions")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--json", help="write raw percentiles as JSON here")
    args = ap.parse_args()
    n_blocks = args.blocks or (100_000 if args.quick else 1_000_000)
    n_requests = args.requests or (2_000 if args.quick else 20_000)
    rng = random.Random(0)

    with open(args.trace) as f:
        recs = [json.loads(line)["hash_ids"] for line in f]
    recs = [r for r in recs if r]
    # The first 80% of the trace (replicated with offset hash ids until the index holds
    # n_blocks) fills the index; the last 20% is the request stream, each request in a
    # random replica: it reuses whatever prefixes the trace itself shares.
    cut = int(len(recs) * 0.8)
    sched, index, cluster, now, replicas = build(n_blocks, rng, recs[:cut])
    held_out = recs[cut:]
    stream = []
    while len(stream) < n_requests:
        base = held_out[len(stream) % len(held_out)]
        r = rng.randrange(replicas)
        stream.append(request_tokens([h + r * REPLICA_OFFSET for h in base], tail=rng.randint(1, BLOCK - 1)))

    # Warm up (first-call effects), then time.
    for toks in stream[:200]:
        sched.plan(hash_blocks(toks, BLOCK, MODEL_ID), len(toks), 32, BLOCK, now)

    # Each decision is timed REPS times back to back: the first timing is what a request
    # saw on this (shared, 2-core) machine, the minimum is the decision's own cost with
    # preemption by other processes filtered out.
    hash_ns, plan_ns, hash_min, plan_min, blocks, reused, dev = [], [], [], [], [], [], []
    xxh3_min = []
    t_now = now
    pc = time.perf_counter_ns
    for toks in stream:
        hs, ps = [], []
        for _ in range(REPS):
            t0 = pc()
            hashes = hash_blocks(toks, BLOCK, MODEL_ID)
            t1 = pc()
            plan = sched.plan(hashes, len(toks), 32, BLOCK, t_now)
            t2 = pc()
            hs.append(t1 - t0)
            ps.append(t2 - t1)
        xs = []
        for _ in range(REPS):
            t0 = pc()
            hash_blocks(toks, BLOCK, XXH3_MODEL_ID)
            xs.append(pc() - t0)
        xxh3_min.append(min(xs))
        hash_ns.append(hs[0])
        plan_ns.append(ps[0])
        hash_min.append(min(hs))
        plan_min.append(min(ps))
        assert isinstance(plan, Plan), plan
        blocks.append(len(hashes))
        reused.append(plan.reusable_blocks)
        dev.append(plan.device_blocks)

    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for toks in stream[:5000]:
            sched.plan(hash_blocks(toks, BLOCK, MODEL_ID), len(toks), 32, BLOCK, t_now)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        print(s.getvalue())

    us = lambda ns: [x / 1000 for x in ns]  # noqa: E731
    p_us, h_us = us(plan_ns), us(hash_ns)
    pm_us, hm_us = us(plan_min), us(hash_min)
    tot_us = [a + b for a, b in zip(p_us, h_us)]
    hit = sum(reused) / max(1, sum(blocks))
    dev_hit = sum(dev) / max(1, sum(blocks))
    rows = [("scheduler.plan (first timing)", p_us), (f"scheduler.plan (min of {REPS})", pm_us),
            ("hash_blocks sha256 (first timing)", h_us), (f"hash_blocks sha256 (min of {REPS})", hm_us),
            (f"hash_blocks xxh3_128 (min of {REPS})", us(xxh3_min)),
            ("hash + plan (first timing)", tot_us)]
    lines = [
        f"Index: {len(index):,} distinct blocks; cluster: {N_MACHINES} prefill + {N_MACHINES} decode + "
        f"{N_STORES} stores; {len(p_us):,} decisions; prompt blocks: median {statistics.median(blocks):.0f}, "
        f"max {max(blocks)}; reusable blocks found {hit:.1%} (device {dev_hit:.1%}).",
        "",
        "| step | p50 (µs) | p90 (µs) | p99 (µs) | mean (µs) |",
        "|---|---|---|---|---|",
    ]
    for name, xs in rows:
        lines.append(f"| {name} | {pct(xs, 50):.1f} | {pct(xs, 90):.1f} | {pct(xs, 99):.1f} | "
                     f"{statistics.fmean(xs):.1f} |")
    # Per-block costs: plan is linear in the chain length (hashing too).
    per_blk = [p / max(1, b) for p, b in zip(pm_us, blocks)]
    ok = pct(pm_us, 99) <= TARGET_P99_US
    lines += ["", f"plan per prompt block (min of {REPS}): median {statistics.median(per_blk):.2f} µs; "
                  f"p99 target {TARGET_P99_US:.0f} µs: {'met' if ok else 'MISSED'} "
                  f"(p99 {pct(pm_us, 99):.1f} µs own cost, {pct(p_us, 99):.1f} µs as first timed)"]
    table = "\n".join(lines)
    publish(table, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps({name: {q: pct(xs, q) for q in (50, 90, 99)} for name, xs in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
