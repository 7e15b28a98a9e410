"""Only a worker's engine thread runs torch on several threads; every other thread runs it on one.

torch's CPU ops parallelize through libgomp, which keeps a team of worker threads for each thread
that starts a parallel region. Once it manages more threads than the machine has CPUs, a worker
sleeps on a futex between regions instead of spinning (libgomp's throttled spin count), so every
region starts with a wake-up. A decode step runs a few hundred short regions: when the event
loop's thread had its own team beside the engine thread's (the model was loaded and profiled on
the loop's thread; checksums, codecs and KV copies run there and on ``asyncio.to_thread``'s
threads), the engine decoded batch 1 at 35 tok/s instead of 44 (bf16, 2 threads, this VM).

So the engine thread builds the engine and keeps the configured number of threads, and the
calling thread then sets one thread as torch's default: threads that start torch work later (the
loop's, executors') take it when they first run a parallel region, and start no team of their own.

The engine's workers then spin between regions (libgomp's default while it has a CPU per thread),
which an engine alone on its cores wants; engines sharing a machine's cores would spin on the
cores the other computes on, and ``mooncake serve`` tells those to sleep instead
(``LocalCluster.engine_env``).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from mooncake.roles.engine_thread import EngineThread

T = TypeVar("T")


def build_on_engine_thread(pool: EngineThread, threads: int, build: Callable[[], T]) -> tuple[T, int]:
    """``build()`` on ``pool``'s thread with ``threads`` torch threads there (0: torch's default),
    then one thread for every other thread of the process. Returns what ``build`` returned and the
    engine thread's number of threads. Call it before the calling thread runs any torch work."""

    def on_engine_thread() -> tuple[T, int]:
        torch.set_num_threads(threads or torch.get_num_threads())
        return build(), torch.get_num_threads()

    built, engine_threads = pool.submit(on_engine_thread, urgency=-1).result()
    torch.set_num_threads(1)  # this thread's count, and the default of threads that start later
    return built, engine_threads
