"""Policies on a real cluster: round_robin spreads a shared prefix; a tight TTFT SLO
rejects part of a burst up front, before any compute, and loses nothing.
Shapes: two prefill instances and a decode: placement between prefill instances (early refusal in
each shape: test_admission.py, test_shapes.py)."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from mooncake.testing.api import MODEL, complete, metric, metrics
from mooncake.testing.cluster import start_cluster

pytestmark = pytest.mark.timeout(900)
SLO_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("data"), prefill=2, decode=1, store=1,
                      policy="round_robin", ttft_slo_ms=SLO_S * 1000)
    yield c
    c.stop()


def test_round_robin_does_not_follow_the_prefix(cluster):
    prefix = list(range(9000, 9400))
    before = metrics(cluster.url)
    for i in range(4):
        assert complete(cluster.url, prefix + [i + 1], max_tokens=2).status_code == 200
    after = metrics(cluster.url)
    per_instance = [metric(after, "mooncake:prefill_dispatched_total", instance=n)
                    - metric(before, "mooncake:prefill_dispatched_total", instance=n)
                    for n in ("node0-prefill", "node1-prefill")]
    assert per_instance == [2, 2]


def test_early_rejection_refuses_part_of_a_burst_before_compute(cluster):
    # Size the burst from the scheduler's own current estimate of one prefill, so that the
    # decisions do not depend on how fast this machine is: two instances can take about
    # 2 x SLO / estimate requests within the SLO, and the burst is twice that.
    est_s = httpx.get(cluster.url + "/cluster").json()["estimates"]["prefill_1k_tokens_s"]
    if not 0 < est_s < SLO_S / 2:
        pytest.skip(f"machine too loaded for a {SLO_S:.0f} s TTFT SLO (one prefill: {est_s:.1f} s)")
    n = min(150, max(8, math.ceil(4 * SLO_S / est_s)))
    before = metrics(cluster.url)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            bodies = [{"model": MODEL, "prompt": [1000 + i] + list(range(4000 + i * 7, 4000 + i * 7 + 1000)),
                       "max_tokens": 4, "temperature": 0} for i in range(n)]
            return await asyncio.gather(*(client.post(cluster.url + "/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    rejected = [r for r in responses if r.status_code == 429]
    admitted = [r for r in responses if r.status_code == 200]
    assert rejected and admitted, codes
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "ttft_slo"
    for r in admitted:
        assert r.json()["usage"]["completion_tokens"] == 4
    after = metrics(cluster.url)
    delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert delta("mooncake:requests_rejected_total", reason="ttft_slo") == len(rejected)
    # No compute was spent on a rejected request: only admitted ones reached a prefill instance.
    assert delta("mooncake:prefill_dispatched_total") == len(admitted)
