"""Interactive traffic under a flex flood, through the served path (issue 32).

A dev cluster as ``mooncake serve`` starts it (``--shape colocated``, the default: one colocated
instance and a store; ``--shape pair``: one prefill, one decode, one store; the config's
defaults but for caches smaller than the flood: ``[engine] kv_cache_bytes`` 256 MiB, store DRAM
64 MiB, no LMDB tier). Interactive requests: a shared ~600-token system prompt and a short
question, 32 tokens out, streamed, one every ``--every-s``. The flood: ``--flood`` requests of
unique ~1,500-token prompts, 128 tokens out, sent at once with ``service_tier: flex`` (or, with
``--flood-class default``, as ordinary requests: classes off). Three phases on one cluster: the
interactive requests alone, then with the flood, then alone again (the cache after the flood).
Per phase: interactive TTFT p50/p90, p90 of each request's mean inter-token time, cached prompt
tokens per request, and the flood's completions and wall time.

``--tenants``: two API keys (issue 51). Key A, bound to ``default`` by ``[classes] api_key_classes``,
sends the flood as a client that does not behave: ``priority: -2147483648``, a ``session_id`` each,
64 tokens out, half of them asking for ``service_tier: priority``; key B sends the interactive
requests. Also reported: the class each of A's requests was served in.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_classes.py \
        [--shape colocated|pair] [--flood 24] [--interactive 12] [--every-s 1.5] [--tbt-slo-ms 0] \
        [--flood-class flex|default] [--tenants] [--max-queue-wait-s S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from mooncake.config import Config, MiB
from mooncake.frontend.tenant_clock import tenant_id
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import running_cluster
from mooncake.testing.ports import free_port

WORDS = ("river valley harbour lantern orchard meadow copper signal engine garden winter market station "
         "library thunder compass island forest bridge canvas").split()


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


SYSTEM = "You are a helpful assistant for a shipping company. Policies: " + text(560, 1)
KEY_A, KEY_B = "sk-bench-tenant-a", "sk-bench-tenant-b"


@dataclass
class Outcome:
    ok: bool
    ttft_s: float = float("nan")
    itl_s: float = float("nan")  # mean gap between its tokens
    cached: int = 0
    tokens: int = 0
    prompt: int = 0  # prompt tokens
    text: str = ""
    request_class: str = ""  # the class it was served in (its chunks' service_tier)


@dataclass
class Phase:
    name: str
    interactive: list[Outcome] = field(default_factory=list)
    flood: list[Outcome] = field(default_factory=list)
    flood_s: float = 0.0
    kept_a: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (most blocks key A kept, its quota)


async def stream(client: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None) -> Outcome:
    t0 = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    pieces: list[str] = []
    request_class = ""
    try:
        async with client.stream("POST", path, headers=headers, json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                await r.aread()
                return Outcome(False, request_class=f"{r.status_code} {r.json().get('error', {}).get('param')}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                request_class = chunk.get("service_tier", request_class)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):  # a token's text (not the chat role's opening chunk)
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        times.append(time.perf_counter())
                        pieces.append(piece)
    except httpx.HTTPError:
        return Outcome(False)
    if not times:
        return Outcome(False)
    gaps = [b - a for a, b in zip(times, times[1:])]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Outcome(True, times[0] - t0, statistics.fmean(gaps) if gaps else 0.0, cached,
                   usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0), "".join(pieces), request_class)


def bearer(key: str) -> dict | None:
    return {"Authorization": f"Bearer {key}"} if key else None


async def interactive(client: httpx.AsyncClient, n: int, every_s: float, seed: int, key: str = "") -> list[Outcome]:
    async def one(i: int) -> Outcome:
        await asyncio.sleep(i * every_s)
        question = f"Question {seed}-{i}: can a parcel to {text(6, seed * 100 + i)} ship today?"
        return await stream(client, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 32, "temperature": 0, "ignore_eos": True}, bearer(key))

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def flood(client: httpx.AsyncClient, n: int, request_class: str, seed: int, key: str = "") -> list[Outcome]:
    """Key A's misbehaving requests (``key``), else flex (or default) requests without a key."""
    async def one(i: int) -> Outcome:
        asks = {"service_tier": request_class, "max_tokens": 128} if not key else {
            "priority": -2**31, "session_id": f"tenant-a-{seed}-{i}", "max_tokens": 64,
            **({"service_tier": "priority"} if i % 2 == 0 else {})}
        return await stream(client, "/v1/completions", {
            "model": MODEL, "prompt": f"Document {seed}-{i}: " + text(1500, seed * 1000 + i) + "\nSummary:",
            "temperature": 0, "ignore_eos": True, **asks}, bearer(key))

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def watch_kept(client: httpx.AsyncClient, phase: Phase, cfg: Config) -> None:
    """Key A's session-kept blocks on each node, from ``GET /cluster`` once a second: the most seen
    and its quota there (``[classes]``: the count, or a share of the node's blocks)."""
    a, classes = tenant_id(KEY_A), cfg.classes
    while True:
        info = (await client.get("/cluster", headers=bearer(KEY_B))).json()
        block_bytes = max((n["kv_block_bytes"] or 0 for n in info["nodes"]), default=0)
        for n in (n for n in info["nodes"] if n["role"] in ("prefill", "decode", "colocated", "store")):
            blocks = n["num_blocks"] or sum(t["capacity_bytes"] for t in n["load"]["tiers"].values()) // max(1, block_bytes)
            quota = min(classes.session_blocks_per_key, max(1, int(classes.session_share_per_key * blocks)))
            kept = n["load"]["kept_by_tenant"].get(a, 0)
            phase.kept_a[n["node_id"]] = (max(kept, phase.kept_a.get(n["node_id"], (0, 0))[0]), quota)
        await asyncio.sleep(1.0)


async def run_phase(url: str, name: str, args: argparse.Namespace, seed: int, with_flood: bool,
                    cfg: Config | None = None) -> Phase:
    phase = Phase(name)
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        t0 = time.perf_counter()
        keys = (KEY_A, KEY_B) if args.tenants else ("", "")
        watch = asyncio.create_task(watch_kept(client, phase, cfg)) if args.tenants and with_flood and cfg else None
        if with_flood:
            flood_task = asyncio.create_task(flood(client, args.flood, args.flood_class, seed, keys[0]))
            await asyncio.sleep(1.0)  # the flood is queued first
        phase.interactive = await interactive(client, args.interactive, args.every_s, seed, keys[1])
        if with_flood:
            phase.flood = await flood_task
            phase.flood_s = time.perf_counter() - t0
        if watch is not None:
            watch.cancel()
    return phase


def p(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


def report(phases: list[Phase]) -> None:
    base = phases[0]
    ok0 = [o for o in base.interactive if o.ok]
    print("| phase | interactive ok | TTFT p50 s | TTFT p90 s | ITL p90 ms | cached tokens (mean) | flood ok | flood s |")
    print("|---|---|---|---|---|---|---|---|")
    for ph in phases:
        ok = [o for o in ph.interactive if o.ok]
        ttft = [o.ttft_s for o in ok]
        itl = [o.itl_s for o in ok]
        flood_ok = f"{sum(o.ok for o in ph.flood)}/{len(ph.flood)}" if ph.flood else "-"
        print(f"| {ph.name} | {len(ok)}/{len(ph.interactive)} | {p(ttft, 50):.2f} | {p(ttft, 90):.2f} | "
              f"{p(itl, 90) * 1e3:.0f} | {statistics.fmean([o.cached for o in ok]) if ok else 0:.0f} | {flood_ok} | "
              f"{ph.flood_s:.0f} |")
    flooded = [o for o in phases[1].interactive if o.ok]
    if ok0 and flooded:
        t0, t1 = p([o.ttft_s for o in ok0], 90), p([o.ttft_s for o in flooded], 90)
        i0, i1 = p([o.itl_s for o in ok0], 90), p([o.itl_s for o in flooded], 90)
        c0, c1 = statistics.fmean([o.cached for o in ok0]), statistics.fmean([o.cached for o in flooded])
        print(f"\nunder the flood: TTFT p90 {t1:.2f} s vs {2 * t0 + 1:.2f} s allowed (2x + 1 s): "
              f"{'met' if t1 <= 2 * t0 + 1 else 'missed'}; ITL p90 {i1 * 1e3:.0f} ms vs {(1.5 * i0 + 0.025) * 1e3:.0f} "
              f"ms allowed (1.5x + 25 ms): {'met' if i1 <= 1.5 * i0 + 0.025 else 'missed'}; cached tokens "
              f"{c1:.0f} vs {0.9 * c0:.0f} wanted (90%): {'met' if c1 >= 0.9 * c0 else 'missed'}")
    if phases[1].flood:
        served = Counter(o.request_class or "-" for o in phases[1].flood)
        print(f"flood served as: {', '.join(f'{t} x{n}' for t, n in served.most_common())} (of {len(phases[1].flood)})")
    if phases[1].kept_a:
        print("key A's kept blocks, most seen / quota: " + ", ".join(
            f"{node} {kept}/{quota}" for node, (kept, quota) in sorted(phases[1].kept_a.items())))


def pressed_config(prefix: str) -> Config:
    """The dev cluster's config with caches smaller than the traffic: a 256 MiB KV pool, 64 MiB of
    store DRAM, no LMDB tier (its data in a new temporary directory)."""
    cfg = Config()
    cfg.frontend.port = free_port()
    cfg.engine.kv_cache_bytes = 256 * MiB
    cfg.store.dram_bytes, cfg.store.lmdb_bytes = 64 * MiB, 0
    cfg.store.data_dir = tempfile.mkdtemp(prefix=prefix)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flood", type=int, default=24)
    ap.add_argument("--interactive", type=int, default=12)
    ap.add_argument("--every-s", type=float, default=1.5)
    ap.add_argument("--flood-class", "--flood-tier", choices=["flex", "default"], default="flex",
                    help="the flood's request class (--flood-tier: its old name, deprecated)")
    ap.add_argument("--tbt-slo-ms", type=float, default=0.0, help="[admission] tbt_slo_ms (0: none)")
    ap.add_argument("--shape", choices=["colocated", "pair"], default="colocated",
                    help="mooncake serve's default (one colocated instance) or --disaggregated (prefill + decode)")
    ap.add_argument("--tenants", action="store_true", help="key A floods as a client that does not behave, key B interactive")
    ap.add_argument("--max-queue-wait-s", type=float, default=None,
                    help="[admission] max_queue_wait_s (default: the config's; 0: every request queues, none refused for its wait)")
    args = ap.parse_args()
    if any(a.startswith("--flood-tier") for a in sys.argv[1:]):
        print("--flood-tier is deprecated: use --flood-class", file=sys.stderr)
    cfg = pressed_config("bench-classes-")
    cfg.admission.tbt_slo_ms = args.tbt_slo_ms
    if args.max_queue_wait_s is not None:
        cfg.admission.max_queue_wait_s = args.max_queue_wait_s
    if args.tenants:
        cfg.frontend.api_key, cfg.frontend.api_keys = KEY_A, [KEY_B]
        cfg.classes.api_key_classes = [f"{KEY_A}=default"]
    shape = {"prefill": 0, "decode": 0, "colocated": 1} if args.shape == "colocated" else {}
    with running_cluster(cfg=cfg, **shape) as c:
        asyncio.run(run_phase(c.url, "warm-up", argparse.Namespace(**{**vars(args), "interactive": 2}), 0, False))
        phases = [asyncio.run(run_phase(c.url, "alone", args, 1, False)),
                  asyncio.run(run_phase(c.url, f"with {args.flood} {args.flood_class} requests", args, 2, True, cfg)),
                  asyncio.run(run_phase(c.url, "alone again", args, 3, False))]
    flooding = "key A (default) asking for priority" if args.tenants else f"flood class {args.flood_class}"
    print(f"{args.shape}, {flooding}, tbt_slo_ms {args.tbt_slo_ms:g}, max_queue_wait_s {cfg.admission.max_queue_wait_s:g}\n")
    report(phases)


if __name__ == "__main__":
    main()
