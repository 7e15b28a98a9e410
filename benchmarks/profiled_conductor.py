"""``mooncake.cli`` with a profiler the benchmark switches on and off by signal.

    python benchmarks/profiled_conductor.py OUT serve --role conductor --config FILE ...

SIGUSR1 starts counting garbage-collector pauses per generation and, with
``BENCH_CONDUCTOR_CPROFILE=1`` in the environment, cProfile on the main thread (the conductor's
event loop); SIGUSR2 stops both and writes ``OUT.gc.json`` (``{generation: [collections,
seconds]}``) and ``OUT`` (pstats, when profiling). Start-up (imports, the tokenizer's loading)
is thus left out of the profile.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import signal
import sys
import time

OUT = sys.argv.pop(1)
profiler = cProfile.Profile() if os.environ.get("BENCH_CONDUCTOR_CPROFILE") == "1" else None
gc_pauses: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
_gc_started = 0.0
_counting = False


def _on_gc(phase: str, info: dict) -> None:
    global _gc_started
    if not _counting:
        return
    if phase == "start":
        _gc_started = time.perf_counter()
    else:
        pause = gc_pauses[info["generation"]]
        pause[0] += 1
        pause[1] += time.perf_counter() - _gc_started


def _start(*_: object) -> None:
    global _counting
    for pause in gc_pauses.values():
        pause[:] = [0, 0.0]
    _counting = True
    if profiler is not None:
        profiler.enable()


def _stop(*_: object) -> None:
    global _counting
    _counting = False
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(OUT)
    with open(OUT + ".gc.json.tmp", "w") as f:
        json.dump(gc_pauses, f)
    os.replace(OUT + ".gc.json.tmp", OUT + ".gc.json")  # whole or absent for the reader


gc.callbacks.append(_on_gc)
signal.signal(signal.SIGUSR1, _start)
signal.signal(signal.SIGUSR2, _stop)

if __name__ == "__main__":
    from mooncake.cli import main

    sys.argv[0] = "mooncake"
    sys.exit(main())
