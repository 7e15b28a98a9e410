"""A decode worker in-process for tests that drive its KV ingress by hand: small pool, CPU,
no start-up profile; a stand-in for its ``send`` that records what it would send; ``until``."""

from __future__ import annotations

import asyncio
from typing import Iterator


class Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    async def __call__(self, msg) -> None:
        self.sent.append(msg)


def small_decode_worker(colocated: bool = False) -> Iterator:
    """Yields a ``DecodeWorker`` (``colocated``: a ``ColocatedWorker``; not started), then shuts
    its pool and context down."""
    from mooncake.config import Config, MiB
    from mooncake.roles.colocated import ColocatedWorker
    from mooncake.roles.decode import DecodeWorker

    cfg = Config()
    cfg.model.device, cfg.engine.kv_cache_bytes, cfg.engine.threads = "cpu", 16 * MiB, 1
    cfg.engine.profile_at_start = False
    w = (ColocatedWorker if colocated else DecodeWorker)(cfg)
    yield w
    w.host.pool.shutdown(wait=False)
    w.host.ctx.term()


async def until(condition, timeout_s: float = 30.0) -> None:
    """Wait until ``condition()`` holds (polled every 10 ms), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
