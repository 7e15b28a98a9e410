"""The load the scheduler has booked on each instance: what it predicts, it books, and
it releases it itself when the request moves on.

Prefill instances: queued work in predicted seconds (a running sum per instance).
Decode instances: the predicted end time of every request assigned to it, kept
sorted so that "how many will still be decoding at time t" is a bisection, and the
KV blocks each one is predicted to hold, so that "when will this many blocks be
free" is a walk over the ends.
Pending blocks: the blocks a booked request will make resident on an instance
(those it computes or receives), so that a request planned behind it on the same
instance counts them as cached.
A ``Booking`` is one request's share of all that, which its holder hands back.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, Container, Iterable

from mooncake.sched.plan import Plan
from mooncake.sched.request_class import DEFAULT_RANK, FLEX_RANK, RANKS


@dataclass
class PrefillQueue:
    """Queued work of one prefill instance, by request class (``sched/request_class.py``):
    the instance serves a lower rank first, so a request waits only for the work of its own
    rank and the ranks before it."""

    work: dict[str, float] = field(default_factory=dict)  # request -> predicted seconds
    deadlines: dict[str, float] = field(default_factory=dict)  # request -> when its first token is due
    ranks: dict[str, int] = field(default_factory=dict)  # request -> its class's rank (absent: DEFAULT_RANK)
    by_rank: list[float] = field(default_factory=lambda: [0.0] * RANKS)  # predicted seconds queued per rank

    def add(self, req_id: str, seconds: float, deadline: float = math.inf, rank: int = DEFAULT_RANK) -> None:
        self.remove(req_id)
        self.work[req_id] = seconds
        self.by_rank[rank] += seconds
        if rank != DEFAULT_RANK:
            self.ranks[req_id] = rank
        if deadline < math.inf:
            self.deadlines[req_id] = deadline

    def remove(self, req_id: str) -> None:
        s = self.work.pop(req_id, None)
        self.deadlines.pop(req_id, None)
        rank = self.ranks.pop(req_id, DEFAULT_RANK)
        if s is not None:
            self.by_rank[rank] = max(0.0, self.by_rank[rank] - s)
            if not self.work:  # left empty: no rounding behind
                self.by_rank = [0.0] * RANKS

    @property
    def total_s(self) -> float:
        """Predicted seconds of all queued work."""
        return sum(self.by_rank)

    def requests_of(self, rank: int) -> int:
        """Requests of class ``rank`` queued here."""
        if rank == DEFAULT_RANK:
            return len(self.work) - len(self.ranks)
        return sum(1 for r in self.ranks.values() if r == rank) if self.ranks else 0

    def ahead_s(self, rank: int = DEFAULT_RANK) -> float:
        """Predicted seconds of queued work a request of ``rank`` waits for (its rank's and those before it)."""
        return sum(self.by_rank[:rank + 1])

    def earliest_deadline(self, now: float, rank: int = DEFAULT_RANK) -> float:
        """The first token due soonest among the queued requests that a newcomer of ``rank``
        would delay (those of its rank and after; never flex ones for an interactive newcomer:
        flex SLOs never cost interactive work its admission) and that are predicted to meet it (inf: none).
        The instance computes them by rank, then in booking order (a packed forward's chunk
        budget goes to the earliest first), so each is predicted done once the work served
        before it is; one already predicted late is left out: refusing newcomers cannot save
        it, and counting it would refuse every newcomer until it is done."""
        if not self.deadlines:
            return math.inf
        order = self.work.items() if not self.ranks else \
            sorted(self.work.items(), key=lambda item: self.ranks.get(item[0], DEFAULT_RANK))  # stable: booking order
        earliest, done_at = math.inf, now
        for req_id, seconds in order:
            done_at += seconds
            deadline = self.deadlines.get(req_id, math.inf)
            queued_rank = self.ranks.get(req_id, DEFAULT_RANK)
            if done_at <= deadline < earliest and queued_rank >= rank and (queued_rank < FLEX_RANK or rank == FLEX_RANK):
                earliest = deadline
        return earliest


@dataclass
class DecodeSlots:
    assigned: dict[str, float] = field(default_factory=dict)  # request -> predicted end time
    by_end: list[tuple[float, str]] = field(default_factory=list)  # (end, request), sorted
    ends: list[float] = field(default_factory=list)  # the ends of ``by_end`` alone (bisected without a key)
    blocks: dict[str, int] = field(default_factory=dict)  # request -> KV blocks it will hold
    blocks_total: int = 0
    kv_tokens: dict[str, int] = field(default_factory=dict)  # request -> KV tokens it holds halfway through
    kv_tokens_total: int = 0

    def add(self, req_id: str, expected_end: float, blocks: int = 0, kv_tokens: int = 0) -> None:
        self.remove(req_id)
        self.assigned[req_id] = expected_end
        j = bisect.bisect_right(self.by_end, (expected_end, req_id))
        self.by_end.insert(j, (expected_end, req_id))
        self.ends.insert(j, expected_end)
        self.blocks[req_id] = blocks
        self.blocks_total += blocks
        self.kv_tokens[req_id] = kv_tokens
        self.kv_tokens_total += kv_tokens

    def remove(self, req_id: str) -> None:
        end = self.assigned.pop(req_id, None)
        if end is not None:
            j = bisect.bisect_left(self.by_end, (end, req_id))
            if j < len(self.by_end) and self.by_end[j] == (end, req_id):
                del self.by_end[j]
                del self.ends[j]
            self.blocks_total -= self.blocks.pop(req_id, 0)
            self.kv_tokens_total -= self.kv_tokens.pop(req_id, 0)

    def next_end_after(self, t: float) -> float:
        """When the first request still decoding at ``t`` is predicted to finish (``t`` if none)."""
        i = bisect.bisect_right(self.ends, t)
        return self.ends[i] if i < len(self.ends) else t

    def running_at(self, t: float) -> int:
        """Assigned requests predicted to still be decoding at time ``t``."""
        return len(self.ends) - bisect.bisect_right(self.ends, t)

    def room_at(self, need: int, capacity: int, t: float) -> float:
        """The earliest time from ``t`` at which ``need`` blocks are free in a pool of
        ``capacity`` (0: unknown, never waits), as booked requests are predicted to end.
        A request larger than the pool waits for it to empty (the decode runs it alone)."""
        if capacity <= 0:
            return t
        held = self.blocks_total
        if held + need <= capacity:
            return t
        for end, req_id in self.by_end:
            held -= self.blocks[req_id]
            if held + need <= capacity or held <= 0:
                return max(t, end)
        return t


class PendingBlocks:
    """Blocks booked requests will make resident on each instance, as a set per instance.

    A set, not counts per block: a booking's chain goes in and out in C (``set.update``,
    ``difference_update``), where counting costs a Python step per block (~0.1-0.2 µs each,
    four times a request's blocks). What that gives up: a booking that ends takes its blocks
    out even where another booking pends them too. When it ends after its prefill they are in
    the KV index by then (its prefill computed or held them, its decode received them); only
    a booking that fails before its prefill leaves those it shared uncounted, and a later plan
    then counts fewer cached blocks than it will find: a pessimistic prediction, until the
    other booking's prefill indexes them."""

    def __init__(self) -> None:
        self._by_node: dict[str, set[bytes]] = {}

    def add(self, node_id: str, hashes: Iterable[bytes]) -> None:
        pending = self._by_node.get(node_id)
        if pending is None:
            self._by_node[node_id] = set(hashes)
        else:
            pending.update(hashes)

    def remove(self, node_id: str, hashes: Iterable[bytes]) -> None:
        pending = self._by_node.get(node_id)
        if pending is not None:
            pending.difference_update(hashes)
            if not pending:
                del self._by_node[node_id]

    def of(self, node_id: str) -> set[bytes] | None:
        return self._by_node.get(node_id)

    def nodes(self) -> Container[str]:
        """The instances with pending blocks (a live view: read it, do not keep it)."""
        return self._by_node.keys()

    def forget_node(self, node_id: str) -> None:
        self._by_node.pop(node_id, None)


class Booking:
    """One request's booked load (its plan's prefill work, a decode slot, the blocks pending on
    both instances), handed back to the scheduler that booked it: ``on_prefill_finished`` and
    ``on_release`` are its hand-backs, each called with the request id."""

    def __init__(self, on_prefill_finished: Callable[[str], None], on_release: Callable[[str], None], req_id: str,
                 plan: Plan, rank: int = DEFAULT_RANK) -> None:
        self._on_prefill_finished, self._on_release = on_prefill_finished, on_release
        self.req_id = req_id
        self.plan = plan
        self.rank = rank  # its class's (``request_class.py``)
        self.hashes = list(plan.hashes)  # pending on both instances until each is done with the request
        self.prefilled = False

    def prefill_finished(self) -> None:
        """The request left its prefill queue (it is decoding now)."""
        self._on_prefill_finished(self.req_id)

    def release(self) -> None:
        """All of its load (the request finished, failed or moved). Idempotent."""
        self._on_release(self.req_id)
