"""One attempt of a request, as the conductor sees it: one try on one prefill/decode pair, booked.

The request itself (its tokens, its client, its retries) belongs to the frontend that
submitted the attempt (``owner``), which also drives the attempt on its workers along the
route the conductor planned (``route``). Workers and frontends know the attempt by its wire id
(``<request id>#<attempt>``), so a message of an earlier attempt matches nothing. It owns its
booking (``booking.plan``: the scheduler's plan; the booked prefill work is released when its
frontend reports the prefill done, the rest when the attempt ends).

::

    booked ──Release(prefilled)──▶ decoding ──Release(ended)──▶ gone
       └────── Release(ended), a node of it lost, its frontend lost ──▶ gone
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from mooncake import protocol as P
from mooncake.sched.booking import Booking
from mooncake.sched.node_registry import Node
from mooncake.sched.plan import Plan


@dataclass(eq=False)
class Attempt:
    submit: P.Submit
    booking: Booking  # booked under the wire id
    started: float  # when it was placed
    route: P.Route
    prefilled: bool = False  # its frontend reported the prefill done
    answered_to: Node | None = None  # the owner's registration its Admitted went to

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


def worker_ref(node: Node) -> P.WorkerRef:
    """How a frontend reaches ``node`` to drive attempts on it."""
    return P.WorkerRef(node.node_id, node.role, node.endpoints.get("orders", ""), node.endpoints.get("kv", ""))


def route_of(plan: Plan, stages: list[P.StagePlan]) -> P.Route:
    """The route a frontend drives ``plan``'s attempt along (``stages``: a pipeline group's)."""
    prefills = plan.stages or [plan.prefill]
    return P.Route(worker_ref(plan.decode), [worker_ref(n) for n in prefills], secrets.token_bytes(16),
                   plan.fetch, plan.store_endpoint, stages,
                   (plan.store_range or (plan.reusable_blocks,))[0] if plan.stages else -1,
                   prefill_beside=not plan.colocated and bool(plan.decode.info.machine)
                   and any(n.info.machine == plan.decode.info.machine for n in prefills),
                   store_range=list(plan.store_range or ()), decode_writes=plan.decode_writes)
