"""One streamed completion against a dev cluster, for the benchmarks that time single long
prompts (bench_layerwise.py, bench_pipeline.py)."""

from __future__ import annotations

import httpx

from mooncake.bench.client import RequestRecord, stream_request


def fresh_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids no other seed's prompt shares a block with (nothing cached for it)."""
    return [(seed * 7919 + i * 7) % 40000 + 1000 for i in range(n)]


async def stream_one(url: str, model: str, ids: list[int], max_tokens: int, label: str,
                     timeout_s: float = 900) -> RequestRecord:
    """Stream one greedy completion of ``ids``; raises when it fails."""
    rec = RequestRecord(0, label, 0, 0.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        await stream_request(client, "/v1/completions",
                             {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True, "stream": True}, rec)
    if not rec.ok:
        raise RuntimeError(f"request failed: {rec.status} {rec.error}")
    return rec
