"""One attempt of a request, as the conductor sees it: one try on one prefill/decode pair.

The request itself (its tokens, its client, its retries) belongs to the frontend that
submitted the attempt (``owner``). Workers know the attempt by its wire id (``<request
id>#<attempt>``), so a message of an earlier attempt matches nothing. It owns its booking
(``booking.plan``: the scheduler's plan; the booked load is released when the attempt ends),
the KV token decode admits KV with, and the prefill request held back until decode has
reserved the KV blocks.

::

    RESERVING ──Reserved──▶ PREFILLING ──PrefillDone──▶ DECODING ──Release (frontend)──▶ gone
          └────────── Failed, node lost, Release(abort) ──────────────────────────────▶ gone
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from mooncake import protocol as P
from mooncake.sched.booking import Booking
from mooncake.sched.plan import Plan


class Phase(enum.Enum):
    RESERVING = "reserving"  # the decode instance is reserving KV blocks
    PREFILLING = "prefilling"  # the prefill instance has it
    DECODING = "decoding"  # first token out; decode streams the rest to the frontend


@dataclass(eq=False)
class Attempt:
    submit: P.Submit
    booking: Booking  # booked under the wire id
    started: float  # when it was dispatched
    reply_to: str = ""  # the owner's token endpoint
    phase: Phase = Phase.RESERVING
    kv_token: bytes = field(default_factory=lambda: secrets.token_bytes(16))  # decode admits KV only from its prefill
    prefill: P.PrefillRequest | None = None  # sent once decode has reserved
    reserved_at: float = 0.0  # when the decode instance had reserved its blocks
    first_token_at: float = 0.0  # when its prefill's token came

    @property
    def wire_id(self) -> str:
        return self.submit.wire_id

    @property
    def owner(self) -> str:
        """The frontend that submitted it."""
        return self.submit.node_id

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

    def reserve_request(self) -> P.DecodeRequest:
        """What asks decode to reserve the KV blocks of the prompt and the tokens so far; the
        prefill request is kept in ``prefill`` until decode has."""
        s, plan = self.submit, self.plan
        self.prefill = P.PrefillRequest(
            s.wire_id, s.tokens, s.hashes, s.root, s.sampling, plan.decode.endpoints["kv"],
            num_generated=s.num_generated, fetch=plan.fetch, store_endpoint=plan.store_endpoint,
            kv_token=self.kv_token)
        return P.DecodeRequest(s.wire_id, s.tokens, s.hashes, s.root, s.sampling, num_generated=s.num_generated,
                               store_endpoint=plan.store_endpoint, kv_token=self.kv_token,
                               store_from_block=plan.reusable_blocks if plan.stages else -1, reply_to=self.reply_to)
