"""Keeping a single-machine cluster up: a role process that dies is started again, with a line
naming it and how it ended; one that keeps dying (``max_restarts`` deaths within ``window_s``)
stops the cluster with an error instead of looping."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections import deque
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class GaveUp(RuntimeError):
    """A role died too often to keep restarting it."""


class Processes(Protocol):
    """What the supervisor needs of a cluster of child processes (``LocalCluster``)."""

    children: dict[str, subprocess.Popen]

    def spawn(self, role: str, index: int = 0) -> subprocess.Popen: ...


def describe_exit(returncode: int) -> str:
    """``exit status 2``, or ``killed by SIGKILL`` for a negative return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def split_name(name: str) -> tuple[str, int]:
    """``prefill1`` -> ("prefill", 1); ``conductor`` -> ("conductor", 0)."""
    role = name.rstrip("0123456789")
    return role, int(name[len(role):] or 0)


class RestartBudget:
    """Deaths of one role within a sliding window."""

    def __init__(self, max_restarts: int = 3, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.deaths: deque[float] = deque()

    def died(self) -> bool:
        """Record a death; True while another restart is allowed."""
        now = self.clock()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        return len(self.deaths) < self.max_restarts


class Supervisor:
    def __init__(self, cluster: Processes, max_restarts: int = 3, window_s: float = 60.0) -> None:
        self.cluster = cluster
        self.budgets = {name: RestartBudget(max_restarts, window_s) for name in cluster.children}

    def check(self) -> None:
        """Restart every role that has died since the last check; raise ``GaveUp`` for one that
        keeps dying."""
        for name, proc in list(self.cluster.children.items()):
            if proc.poll() is None:
                continue
            how = describe_exit(proc.returncode)
            budget = self.budgets[name]
            if not budget.died():
                raise GaveUp(f"{name} keeps dying ({len(budget.deaths)} times in {budget.window_s:.0f} s, "
                             f"last: {how}); stopping the cluster — its log lines above say why")
            log.warning("%s (pid %d) died (%s); restarting it", name, proc.pid, how)
            role, index = split_name(name)
            new = self.cluster.spawn(role, index)
            log.warning("%s restarted (pid %d)", name, new.pid)
