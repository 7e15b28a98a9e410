"""Choices of one prompt (``n`` > 1): the first is dispatched at once, the others wait for its
prefill and then take the prompt's KV from the prefill instance's cache, so the prompt is
computed once (each other choice computes only the tail past the last full block)."""

from __future__ import annotations

import time
from typing import Callable

from mooncake import protocol as P
from mooncake.frontend.request import Request, RequestError


class Forks:
    def __init__(self, start: Callable[[Request], None]) -> None:
        """``start``: places a released choice (the frontend's, which may finish it)."""
        self.start = start
        self.waiting: dict[str, Request] = {}

    def fork(self, leader: Request, sampling: P.Sampling) -> Request:
        """Another choice of ``leader``'s prompt with its own ``sampling``."""
        leader.forks += 1
        req = Request(f"{leader.req_id}.{leader.forks}", list(leader.tokens), list(leader.hashes), leader.root,
                      sampling, time.monotonic(), trace=leader.trace)
        self.waiting[req.req_id] = req
        if leader.done or leader.first_token_at:
            self._start([req])
        else:
            leader.followers.append(req)
        return req

    def release(self, leader: Request) -> None:
        """``leader``'s prefill is done (or it ended): its waiting choices start."""
        self._start(leader.followers)
        leader.followers.clear()

    def _start(self, reqs: list[Request]) -> None:
        for req in list(reqs):
            if self.waiting.pop(req.req_id, None) is not None:  # else cancelled meanwhile
                self.start(req)

    def cancel(self, req_id: str) -> bool:
        req = self.waiting.pop(req_id, None)
        if req is not None:
            req.finish(P.FinishReason.ABORT)
        return req is not None

    def close(self, why: str) -> None:
        for req in self.waiting.values():
            req.finish(P.FinishReason.ABORT, RequestError(why))
        self.waiting.clear()
