"""What one tenant (API key) may write to a store per minute (``tiers/write_budget.py``, issue 51):
a bucket per tenant, full at first, refilled at the budget per minute; a put past it stores the
blocks that fit and drops the rest; no keys, no budget."""

from __future__ import annotations

import torch

from mooncake import protocol as P
from mooncake.kv.integrity import Rejections, checksums
from mooncake.tiers.memory import DramTier
from mooncake.tiers.store_requests import StoreRequests
from mooncake.tiers.tiered import TieredStore
from mooncake.tiers.write_budget import WINDOW_S, WriteBudget


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_writes_its_budget_then_what_a_minute_refills():
    clock = Clock()
    budget = WriteBudget(10_000, clock)
    assert budget.admit("key-a", [4000, 4000, 4000]) == 2  # the third does not fit
    assert budget.admit("key-b", [4000] * 3) == 2  # each tenant its own bucket
    assert budget.admit("key-a", [1000]) == 1 and budget.admit("key-a", [2000]) == 0
    clock.now = WINDOW_S / 2  # half a minute: half the budget back
    assert budget.admit("key-a", [4000, 4000]) == 1  # 1000 left + 5000
    clock.now = 10 * WINDOW_S  # never more than the budget
    assert budget.admit("key-a", [6000, 6000]) == 1
    assert budget.admit("", [10**9] * 3) == 3 and WriteBudget(0, clock).admit("key-a", [10**9]) == 1  # no keys; no budget
    assert budget.written == {"key-a": 8000 + 1000 + 4000 + 6000, "key-b": 8000, "": 3 * 10**9}
    assert budget.dropped == {"key-a": 4000 + 2000 + 4000 + 6000, "key-b": 4000}


def test_the_buckets_kept_are_those_of_tenants_that_wrote_within_a_minute():
    clock = Clock()
    budget = WriteBudget(1000, clock)
    for i in range(200):
        budget.admit(f"key-{i}", [1000])
        clock.now += 1.0
    assert len(budget._buckets) <= WINDOW_S + 2


async def test_a_store_stores_a_tenants_puts_up_to_its_budget():
    store = TieredStore([DramTier(64 * 1024)])
    requests = StoreRequests(store, Rejections(), workers=1)
    requests.budget = WriteBudget(2 * 1024)  # two 1 KiB blocks a minute
    blocks = [torch.full((256,), float(i)) for i in range(3)]
    try:
        put = P.Put([bytes([i]) * 32 for i in range(3)], [], checksums=checksums(blocks), tenant="key-a")
        reply, = await requests.handle(put, blocks)
        assert P.decode([reply])[0].count == 2 and store.tier_of(bytes([2]) * 32) is None
        put = P.Put([bytes([9]) * 32], [], checksums=checksums(blocks[:1]), tenant="")
        reply, = await requests.handle(put, blocks[:1])
        assert P.decode([reply])[0].count == 1  # no key: no budget
    finally:
        requests.close()
        store.close()
