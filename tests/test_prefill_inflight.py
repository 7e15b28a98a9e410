"""A request whose prefix another running request on the same instance (a prefill or a colocated
one) is computing waits for it and reuses its blocks, instead of computing them a second time
alongside it."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mooncake.blocks import BlockHash
from mooncake.roles.prefill_inflight import InflightBlocks
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import SHAPES, running_cluster

H = [BlockHash(bytes([i]) * 32) for i in range(8)]


@pytest.mark.asyncio
async def test_a_follower_waits_for_the_request_computing_its_next_block():
    inflight = InflightBlocks()
    assert inflight.computing(H[:6], 0) is None  # nobody computes anything
    inflight.start("leader", H[:6], 2)  # blocks 0-1 cached, it computes 2-5
    assert inflight.computing(H[:8], 1) is None  # block 1 is cached, not being computed
    done = inflight.computing(H[:8], 2)
    assert done is not None and not done.is_set()
    waiter = asyncio.create_task(done.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    inflight.finish("leader")
    await asyncio.wait_for(waiter, 1)
    assert inflight.computing(H[:8], 2) is None and len(inflight) == 0
    inflight.finish("leader")  # idempotent


def test_blocks_another_request_computes_stay_its_own():
    inflight = InflightBlocks()
    inflight.start("a", H[:4], 0)
    inflight.start("b", H[:6], 4)  # b computes 4-5 only
    inflight.start("c", H[:6], 2)  # 2-3 are a's, 4-5 b's: c claims nothing
    inflight.finish("c")
    assert inflight.computing(H, 2) is inflight._claims["a"][1]
    assert inflight.computing(H, 4) is inflight._claims["b"][1]
    inflight.finish("a")
    assert inflight.computing(H, 2) is None and inflight.computing(H, 4) is not None


@pytest.mark.parametrize("shape", list(SHAPES))
def test_concurrent_requests_on_one_prefix_compute_it_once(tmp_path, shape):
    """Two requests with the same 1,200-token prompt at once, one prefill instance (packed
    forwards of 512 tokens: the first takes 3 chunks): the second reuses every full block the
    first computed, where it used to find only the chunks done when it started."""
    prompt = [1000 + (7 * i) % 5000 for i in range(1200)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": False}
    with running_cluster(tmp_path, store=1, use_store=False, **SHAPES[shape]) as c:
        with ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda _: httpx.post(c.url + "/v1/completions", json=body, timeout=120), range(2)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    cached = sorted(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in rs)
    assert cached == [0, (1200 - 1) // 16 * 16]  # at least one token is computed
    assert rs[0].json()["choices"][0]["text"] == rs[1].json()["choices"][0]["text"]
