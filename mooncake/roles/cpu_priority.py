"""Prefill yields the CPU to decode where the two share a machine's cores.

A decode step is short and a token waits on it; a prefill chunk is long (up to a second
of one core here) and only its own request's TTFT waits on it. When both run on the same
cores, every decode step that wakes while the prefill processes hold them waits behind a
chunk, and time between tokens grows by that much (BENCHMARKS.md section 11). So a prefill
role lowers its own scheduling priority at start (``[node] prefill_nice``): the kernel then
runs a waking decode step first, and prefill gets the cores the decode leaves.

Two levels, both needed on Linux:

* every thread's nice value (``setpriority``): on Linux the nice value is per thread,
  and threads created later inherit their creator's, so all existing threads are set;
* the nice value of the process's *autogroup* (``/proc/self/autogroup``), when the
  process leads its own session: with ``kernel.sched_autogroup_enabled`` (the default of
  most distributions) each session is one scheduling group, and a thread's nice value
  only weighs against threads of its own session — a role started in a session of its
  own (``mooncake serve --dev`` does that; so do most service managers) would otherwise
  compete with decode at full weight whatever its threads' nice values say.

Raising one's own nice value needs no privilege; nothing here ever lowers it (a process
started under ``nice -n 15`` stays at 15).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

AUTOGROUP = Path("/proc/self/autogroup")
TASKS = Path("/proc/self/task")


def thread_ids() -> list[int]:
    """This process's threads (Linux), else just the calling one."""
    try:
        return [int(t) for t in os.listdir(TASKS)]
    except OSError:
        return [0]


def autogroup_nice(pid: int | str = "self", proc: Path = Path("/proc")) -> int | None:
    """The nice value of ``pid``'s autogroup, or None when it has none: a kernel without
    autogroup scheduling has no file, and a process still in the boot session's default
    group (a container's PID 1 and whatever never left its session) reads it empty."""
    try:
        text = (proc / str(pid) / "autogroup").read_text()
    except OSError:
        return None
    _, sep, value = text.partition(" nice ")
    return int(value) if sep else None


def raise_nice(nice: int) -> None:
    """Make every thread of this process, and its session's autogroup if it leads one, at
    least ``nice`` (0-19). A failure is logged, never fatal: the role still serves."""
    if nice <= 0:
        return
    for tid in thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:  # a thread that just exited, or a sandbox that forbids it
            log.warning("could not set the nice value of thread %d to %d: %s", tid, nice, e)
    if os.getsid(0) != os.getpid():
        return  # the autogroup is shared with the rest of the session (decode, maybe): leave it
    current = autogroup_nice()
    if current is None or current >= nice:
        return
    try:
        AUTOGROUP.write_text(str(nice))
    except OSError as e:
        log.warning("could not set this session's autogroup nice value to %d: %s", nice, e)


def apply_role_priority(role: str, prefill_nice: int) -> None:
    """At the start of a role process, before its engine starts threads: prefill roles
    yield to decode (``[node] prefill_nice``); every other role keeps its priority."""
    if role == "prefill":
        raise_nice(prefill_nice)
