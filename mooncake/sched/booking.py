"""The load the scheduler has booked on each instance: what it predicts, it books, and
it releases it itself when the request moves on.

Prefill instances: queued work in predicted seconds (a running sum per instance).
Decode instances: the predicted end time of every request assigned to it, kept
sorted so that "how many will still be decoding at time t" is a bisection.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class PrefillQueue:
    work: dict[str, float] = field(default_factory=dict)  # request -> predicted seconds
    total_s: float = 0.0

    def add(self, req_id: str, seconds: float) -> None:
        self.remove(req_id)
        self.work[req_id] = seconds
        self.total_s += seconds

    def remove(self, req_id: str) -> None:
        s = self.work.pop(req_id, None)
        if s is not None:
            self.total_s = max(0.0, self.total_s - s) if self.work else 0.0


@dataclass
class DecodeSlots:
    assigned: dict[str, float] = field(default_factory=dict)  # request -> predicted end time
    ends: list[float] = field(default_factory=list)  # the same values, sorted

    def add(self, req_id: str, expected_end: float) -> None:
        self.remove(req_id)
        self.assigned[req_id] = expected_end
        bisect.insort(self.ends, expected_end)

    def remove(self, req_id: str) -> None:
        end = self.assigned.pop(req_id, None)
        if end is not None:
            i = bisect.bisect_left(self.ends, end)
            if i < len(self.ends) and self.ends[i] == end:
                del self.ends[i]

    def next_end_after(self, t: float) -> float:
        """When the first request still decoding at ``t`` is predicted to finish (``t`` if none)."""
        i = bisect.bisect_right(self.ends, t)
        return self.ends[i] if i < len(self.ends) else t

    def running_at(self, t: float) -> int:
        """Assigned requests predicted to still be decoding at time ``t``."""
        return len(self.ends) - bisect.bisect_right(self.ends, t)
