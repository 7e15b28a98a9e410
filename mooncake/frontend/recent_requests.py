"""Requests finished on this frontend in the last few minutes, with their timelines
(``GET /v1/requests/{id}``): a ring bounded in time and in count, found by the request's id or
by the X-Request-Id it was sent with."""

from __future__ import annotations

import time
from collections import OrderedDict

from mooncake.frontend.timing import RECENT_KEEP_S

MAX_KEPT = 4096


class RecentRequests:
    def __init__(self, keep_s: float = RECENT_KEEP_S, max_kept: int = MAX_KEPT) -> None:
        self.keep_s, self.max_kept = keep_s, max_kept
        self._ring: OrderedDict[str, tuple[float, dict]] = OrderedDict()  # request id -> (when, record)
        self._alias: dict[str, str] = {}  # X-Request-Id -> request id

    def put(self, req_id: str, record: dict, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._ring[req_id] = (now, record)
        self._ring.move_to_end(req_id)
        self._evict(now)

    def alias(self, other_id: str, req_id: str) -> None:
        """``other_id`` (the client's X-Request-Id) finds ``req_id`` too."""
        if req_id in self._ring and other_id != req_id:
            self._alias[other_id] = req_id

    def get(self, some_id: str) -> dict | None:
        self._evict(time.monotonic())
        kept = self._ring.get(some_id) or self._ring.get(self._alias.get(some_id, ""))
        return kept[1] if kept else None

    def _evict(self, now: float) -> None:
        while self._ring:
            req_id, (when, _) = next(iter(self._ring.items()))
            if len(self._ring) <= self.max_kept and now - when <= self.keep_s:
                break
            self._ring.popitem(last=False)
        if len(self._alias) > 2 * self.max_kept or (self._alias and not self._ring):
            self._alias = {k: v for k, v in self._alias.items() if v in self._ring}
