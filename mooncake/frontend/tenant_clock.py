"""The fair order among tenants (API keys; without keys, one tenant) within a request class: a
virtual clock per tenant (VirtualClock, Zhang 1990, with the wall clock as the system's time).

A request's ``fair_tag`` is the later of when it arrived and its tenant's last tag, plus its
prompt tokens times ``token_s`` (``[classes] fair_token_ms``) over the tenant's weight. ``token_s``
is set above what a token really costs, so a burst's tags run ahead of the wall clock faster than
the burst is served, and requests that arrive meanwhile go ahead of its later ones. Once a
prompt's first token says how much of it came from a cache, that part is given back to its
tenant's clock: a chat client resending a long cached history is charged for what it computes.

Queues serve lower tags first among requests of one class and priority
(``sched/request_class.urgency``), so a tenant that sends a burst has its later requests ordered
after other tenants' requests that arrive meanwhile, in proportion to the tokens it sent, and an
idle tenant's request goes near the front. Nothing starves: a request goes ahead of everything
that arrives after its tag. Tags are wall-clock times, so they compare across frontends (a
tenant spread over several frontends keeps a clock on each)."""

from __future__ import annotations

import hashlib
import time
from typing import Callable

from mooncake.frontend.timing import FAIR_TOKEN_S

MAX_TENANTS = 4096  # clocks kept; those already behind the wall clock are forgotten first (they equal a new one)


class TenantClock:
    def __init__(self, token_s: float = FAIR_TOKEN_S, clock: Callable[[], float] = time.time) -> None:
        self.token_s = token_s
        self._clock = clock
        self._last: dict[str, float] = {}  # each tenant's last tag
        self._weight: dict[str, float] = {}

    def tag(self, tenant: str, tokens: int, weight: float = 1.0) -> float:
        """The fair tag of ``tenant``'s request of ``tokens`` prompt tokens, arriving now."""
        now = self._clock()
        tag = max(now, self._last.get(tenant, now)) + tokens * self.token_s / weight
        if len(self._last) >= MAX_TENANTS and tenant not in self._last:
            self._last = {t: last for t, last in self._last.items() if last > now}
            self._weight = {t: w for t, w in self._weight.items() if t in self._last}
        self._last[tenant], self._weight[tenant] = tag, weight
        return tag

    def refund(self, tenant: str, tokens: int) -> None:
        """``tokens`` of a request ``tenant`` was charged for came from a cache: its clock goes back
        by them (never behind the wall clock)."""
        if tenant in self._last and tokens > 0:
            back = self._last[tenant] - tokens * self.token_s / self._weight[tenant]
            self._last[tenant] = max(back, self._clock())


def tenant_id(api_key: str) -> str:
    """The id of ``api_key``'s tenant in orders, metrics and ``/cluster`` (a digest, never the key);
    "" without a key."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:12] if api_key else ""
