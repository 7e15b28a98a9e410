"""Who keeps each session-kept key (the engine's prefix cache, a store tier's LRU), and how many one
tenant (API key; no keys: one tenant, "") may keep at once: ``[classes] session_blocks_per_key``,
and for a tenant with a key, ``session_share_per_key`` of the cache's capacity (in blocks; the
owner says what that is), whichever is smaller. Without keys there is one tenant, whose sessions
may keep the whole cache up to the count.

A kept key is owned by the tenant whose request kept it last. Per tenant its keys are held in the
order they were kept; when a tenant keeps one more than its quota, its oldest ones are handed back
to the caller, which makes them ordinary (as if their time were up). Entries exist only for the
keys kept now: the caller drops a key when it stops being kept (expiry, eviction, removal).

Thread safety: the owner changes it on one thread; ``counts`` may be read from another."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterable, TypeVar

K = TypeVar("K", bound=Hashable)


class TenantQuota(Generic[K]):
    def __init__(self, quota: int = 0, share: float = 0.0) -> None:
        self.quota = quota  # keys one tenant may keep at once; 0: no limit
        self.share = share  # of ``capacity``, what a tenant with a key may keep; 0: no limit
        self.capacity = 0  # keys the cache holds (its owner sets it; 0: unknown, no share limit)
        self._owner: dict[K, str] = {}
        self._by_tenant: dict[str, OrderedDict[K, None]] = {}  # each kept earliest first

    def keep(self, key: K, tenant: str) -> list[K]:
        """``tenant`` keeps ``key`` (its most recently kept now); returns the tenant's oldest keys
        past its quota, no longer tracked here: the caller makes them ordinary."""
        self.drop(key)
        self._owner[key] = tenant
        keys = self._by_tenant.setdefault(tenant, OrderedDict())
        keys[key] = None
        over: list[K] = []
        limit = self.limit(tenant)
        while limit and len(keys) > limit:
            old, _ = keys.popitem(last=False)
            del self._owner[old]
            over.append(old)
        return over

    def limit(self, tenant: str) -> int:
        """The keys ``tenant`` may keep at once (0: no limit)."""
        if not (tenant and self.share and self.capacity):
            return self.quota
        by_share = max(1, int(self.share * self.capacity))
        return min(self.quota, by_share) if self.quota else by_share

    def drop(self, key: K) -> None:
        """``key`` is no longer kept (a key not kept: nothing)."""
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return
        keys = self._by_tenant[tenant]
        del keys[key]
        if not keys:
            del self._by_tenant[tenant]

    def owners(self) -> dict[K, str]:
        """Each kept key's tenant (a copy)."""
        return dict(self._owner)

    def counts(self) -> dict[str, int]:
        """Kept keys per tenant (safe to call from another thread: the dict is copied in one step)."""
        return {tenant: len(keys) for tenant, keys in self._by_tenant.copy().items()}

    def __len__(self) -> int:
        return len(self._owner)

    def check(self, kept: Iterable[K]) -> None:
        """Assert that exactly ``kept`` are owned, each once, no tenant past its quota (tests)."""
        assert set(self._owner) == set(kept), "owned keys differ from the kept ones"
        assert sum(len(keys) for keys in self._by_tenant.values()) == len(self._owner)
        for tenant, keys in self._by_tenant.items():
            assert keys and all(self._owner[k] == tenant for k in keys), tenant
            assert not self.limit(tenant) or len(keys) <= self.limit(tenant), (tenant, len(keys), self.limit(tenant))
