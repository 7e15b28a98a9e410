"""One attempt of a request: one try on one prefill/decode pair, and everything it holds.

Workers know it by its wire id (``<request id>#<attempt>``), so a message of an earlier
attempt matches nothing. It owns its booking (``booking.plan``: the scheduler's plan; the
booked load is released when the attempt ends), the KV token decode admits KV with, and
the prefill request held back until decode has reserved the KV blocks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake import protocol as P
from mooncake.sched.booking import Booking
from mooncake.sched.plan import Plan

if TYPE_CHECKING:
    from mooncake.conductor.request import Request


@dataclass(eq=False)
class Attempt:
    request: Request
    number: int
    booking: Booking  # booked under the wire id
    started: float  # when it was dispatched
    kv_token: bytes = field(default_factory=lambda: secrets.token_bytes(16))  # decode admits KV only from its prefill
    prefill: P.PrefillRequest | None = None  # sent once decode has reserved
    reserved_at: float = 0.0  # when the decode instance had reserved its blocks
    first_token_at: float = 0.0  # when its prefill's token came
    tokens_before: int = 0  # tokens generated before that one (earlier attempts)

    @property
    def wire_id(self) -> str:
        return f"{self.request.req_id}#{self.number}"

    @property
    def plan(self) -> Plan:
        return self.booking.plan

    @property
    def nodes(self) -> set[str]:
        """Every instance it runs on (the prefill stages and the decode instance)."""
        return {*self.plan.prefill_ids, self.plan.decode.node_id}

    def runs(self, role: str, node_id: str) -> bool:
        """Whether its ``role`` part ("prefill": the last stage) runs on ``node_id``."""
        return (self.plan.prefill if role == "prefill" else self.plan.decode).node_id == node_id

    def reserve_request(self, tokens: list[int], hashes: list[bytes]) -> P.DecodeRequest:
        """What asks decode to reserve the KV blocks of ``tokens`` (the prompt and the tokens
        so far); the prefill request is kept in ``prefill`` until decode has."""
        req, plan, n = self.request, self.plan, len(self.request.generated)
        self.prefill = P.PrefillRequest(
            self.wire_id, tokens, hashes, req.root, req.sampling, plan.decode.endpoints["kv"], num_generated=n,
            fetch=plan.fetch, store_endpoint=plan.store_endpoint, kv_token=self.kv_token)
        return P.DecodeRequest(self.wire_id, tokens, hashes, req.root, req.sampling, num_generated=n,
                               store_endpoint=plan.store_endpoint, kv_token=self.kv_token,
                               store_from_block=plan.reusable_blocks if plan.stages else -1)
