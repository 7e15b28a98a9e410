"""The conductor benchmark's load: prompt texts, and open-loop (Poisson) or closed-loop
``/v1/completions`` requests, half of them streamed, each checked for its full token count."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from mooncake.bench.client import RequestRecord, stream_request
from mooncake.bench.prompts import TokenRange, ids_to_text, seeded_token_ids


def prompts(n: int, seed: int = 7) -> list[str]:
    """``n`` prompt texts of 200-2,000 words (about one token each); every other one opens with
    one of 8 shared prefixes (half its length, at most 1,000 words), the rest is its own."""
    rng = random.Random(seed)
    tr = TokenRange()
    shared = [seeded_token_ids((seed, g), 1000, tr) for g in range(8)]
    out = []
    for i in range(n):
        length = rng.randint(200, 2000)
        head = shared[i % 8][:min(1000, length // 2)] if i % 2 == 0 else []
        out.append(ids_to_text(head + seeded_token_ids((seed, 100 + i), length - len(head), tr)))
    return out


async def one_request(client: httpx.AsyncClient, body: dict, i: int) -> tuple[bool, float, bool]:
    """(ok, end-to-end seconds, streamed) of one completion."""
    t0 = time.perf_counter()
    if body["stream"]:
        rec = RequestRecord(i, "", 0, 0.0)
        await stream_request(client, "/v1/completions", body, rec)
        return rec.ok and rec.completion_tokens == body["max_tokens"], time.perf_counter() - t0, True
    try:
        r = await client.post("/v1/completions", json=body)
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == body["max_tokens"]
    except (httpx.HTTPError, ValueError, KeyError):
        ok = False
    return ok, time.perf_counter() - t0, False


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))


def request_body(model: str, texts: list[str], max_tokens: int, seed: int, i: int) -> dict:
    """Request ``i`` of a step: every other one streamed."""
    body = {"model": model, "prompt": texts[(seed * 7919 + i) % len(texts)], "max_tokens": max_tokens,
            "stream": i % 2 == 0}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


async def offer(url: str, model: str, rate: float, duration_s: float, texts: list[str], max_tokens: int,
                grace_s: float, seed: int, concurrency: int = 0) -> dict:
    """Poisson arrivals at ``rate`` for ``duration_s`` (or, with ``concurrency``, that many clients
    each sending its next request when the last is answered); waits ``grace_s`` more for stragglers."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    async with httpx.AsyncClient(base_url=url, timeout=duration_s + grace_s + 30, limits=limits) as client:
        tasks: list[asyncio.Task] = []
        t0, at = time.perf_counter(), 0.0
        results: list[tuple[bool, float, bool]] = []

        async def closed_loop() -> None:
            while time.perf_counter() - t0 < duration_s:
                i = len(results)
                results.append(await one_request(client, request_body(model, texts, max_tokens, seed, i), i))

        while concurrency and len(tasks) < concurrency:
            tasks.append(asyncio.create_task(closed_loop()))
        while not concurrency:
            at += rng.expovariate(rate)
            if at >= duration_s:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            i = len(tasks)
            tasks.append(asyncio.create_task(one_request(client, request_body(model, texts, max_tokens, seed, i), i)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.01, t0 + duration_s + grace_s - time.perf_counter()))
        end = time.perf_counter()
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    if concurrency:
        return {"sent": len(results) + len(pending), "results": results, "wall_s": end - t0}
    return {"sent": len(tasks), "results": [t.result() for t in done], "wall_s": end - t0}
