"""A conductor that has just started (a new leader, a restart) adopts the attempts already running.

Its workers and frontends come to it with what they hold: each worker re-registers listing the
requests it holds, each frontend sends the attempts it drives (``Claims``: the submit and the
route). For ``window_s`` after the start a worker keeps what it holds even when no frontend has
claimed it yet (the frontend may come a moment later), and a claim is adopted (booked on its
route, as if placed here) once every instance of its route has registered, unless one of them
registered as another process (it restarted: the attempt ends, and its frontend moves the
request). ``window_s`` after it was first heard of, what nobody claimed is aborted on the workers
that hold it (the frontend that drove it is gone) and a claim whose instances did not come back
ends. A frontend that dies takes its pending claims with it. A frontend reports the prefill and
the end of every attempt it claimed, as of one a conductor placed, so every booking is released.

After the window, a claim this conductor does not know means it ended the attempt (a node of
it was lost, its frontend was declared dead): the frontend hears ``AttemptEnded``. Attempts a
frontend placed itself while no conductor led (``route.planned`` False; a worker's registration
marks them) are kept and adopted the same way whenever they come: no conductor ever knew them
(one whose instances never register here is forgotten, not ended: its frontend drives it on).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mooncake import protocol as P
from mooncake.sched.node_registry import Cluster
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.sched.plan import Plan


class Adoption:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.until = -math.inf  # closed until ``begin``
        self.claims: dict[str, P.Claim] = {}  # wire id -> claimed, not adopted yet (its route's instances missing)
        self.held: dict[str, set[str]] = {}  # wire id -> the workers keeping it unclaimed
        self.due: dict[str, float] = {}  # wire id (claimed or held) -> when it is settled if not adopted

    def begin(self, now: float) -> None:
        self.until = now + self.window_s

    def is_open(self, now: float) -> bool:
        return now < self.until

    def hold(self, wire_id: str, node_id: str, now: float, fallback: bool = False) -> bool:
        """A registering worker holds an attempt this conductor does not know: whether it keeps it
        for now (in the window, placed by a frontend alone, or already claimed: its frontend may
        claim it, or has)."""
        if not (self.is_open(now) or fallback or wire_id in self.claims):
            return False
        self.held.setdefault(wire_id, set()).add(node_id)
        self.due.setdefault(wire_id, now + self.window_s)
        return True

    def take(self, claim: P.Claim, now: float) -> bool:
        """A claim of an attempt this conductor does not know: whether it may be adopted."""
        if self.is_open(now) or not claim.route.planned:
            self.claims[claim.submit.wire_id] = claim
            self.due.setdefault(claim.submit.wire_id, now + self.window_s)
            return True
        return False

    def claim(self, wire_id: str, owner: str) -> P.Claim | None:
        """``owner``'s claim of ``wire_id``, not adopted yet."""
        c = self.claims.get(wire_id)
        return c if c is not None and c.submit.node_id == owner else None

    def forget_owner(self, owner: str) -> None:
        """Frontend ``owner`` died: its claims go (what workers hold of them is dropped when due)."""
        for wire_id in [w for w, c in self.claims.items() if c.submit.node_id == owner]:
            del self.claims[wire_id]

    def forget(self, wire_id: str) -> None:
        """Adopted, or its frontend ended it before it was."""
        self.claims.pop(wire_id, None)
        self.held.pop(wire_id, None)
        self.due.pop(wire_id, None)

    def settle(self, now: float, known: Callable[[str], bool]) -> tuple[list[P.Claim], dict[str, set[str]]]:
        """(the claims past due that cannot be adopted, the unclaimed attempts past due and the
        workers holding them); both are forgotten. ``known(wire_id)``: adopted since."""
        late = [w for w, t in self.due.items() if t <= now]
        lost = [c for w in late if (c := self.claims.get(w)) is not None]
        orphans = {w: nodes for w in late if (nodes := self.held.get(w)) and not known(w)}
        for w in late:
            self.forget(w)
        return lost, orphans


def adopted_plan(claim: P.Claim, cluster: Cluster, prefill_cost: PrefillCostModel, decode_cost: DecodeCostModel,
                 block_tokens: int, now: float) -> Plan | str | None:
    """The plan a claimed attempt is booked under: its route, with predictions made now (the
    whole prompt to compute unless its prefill is done); None while an instance of the route
    has not registered; why it cannot be adopted, when an instance of the route registered
    since as another process (its orders socket elsewhere: what it held is gone)."""
    route = claim.route
    prefills = [cluster.get(w.node_id) for w in route.prefills]
    decode = cluster.get(route.decode.node_id)
    if decode is None or not prefills or any(p is None for p in prefills):
        return None
    for ref, node in zip([route.decode, *route.prefills], [decode, *prefills]):
        if node is not None and node.endpoints.get("orders", "") != ref.orders:
            return f"{ref.role} instance {ref.node_id} restarted"
    s = claim.submit
    n_tokens, remaining = s.n_tokens, max(1, s.sampling.max_tokens - s.num_generated)
    prefill_s = 0.0 if claim.prefilled else prefill_cost.predict(n_tokens, 0)
    kv_tokens = n_tokens + remaining // 2
    tbt = decode_cost.predict(1, kv_tokens)
    full = min(len(s.hashes), n_tokens // block_tokens)
    return Plan(prefills[-1], decode, list(claim.route.fetch), claim.route.store_endpoint, 0, 0, prefill_s, prefill_s,
                prefill_s, 1, tbt, now + prefill_s + remaining * tbt,
                decode_blocks=-(-(n_tokens + remaining) // block_tokens) + 1, decode_kv_tokens=kv_tokens,
                hashes=s.hashes[:full], stages=prefills if len(prefills) > 1 else [])
