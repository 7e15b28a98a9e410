"""Instances that share one machine's cores: processor sharing.

A real cluster gives each instance hardware of its own, and the simulator's default
is that. A dev cluster (``mooncake serve --dev``, or several roles on one small box)
runs every engine process on the same cores: while ``k`` instances compute with ``t``
threads each on ``c`` cores, each runs at ``min(1, c / (k * t))`` of its own speed.
The costs a ``Hardware`` gives are each instance's own speed; the simulator stretches
them by the sharing in force while the work runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Colocation:
    """All simulated instances run on one machine of ``cores`` cores, ``threads`` each."""

    cores: float
    threads: float = 1.0

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.threads <= 0:
            raise ValueError("cores and threads must be positive")


class SharedCpu:
    """Which instances compute now, and the speed each of them gets."""

    def __init__(self, colocation: Colocation) -> None:
        self.colocation = colocation
        self.computing: set[str] = set()  # node ids

    def speed(self) -> float:
        demand = len(self.computing) * self.colocation.threads
        return min(1.0, self.colocation.cores / demand) if demand else 1.0

    def set_computing(self, node_id: str, computing: bool) -> bool:
        """Mark an instance busy or idle; True when that changed the set (and so the speed)."""
        if computing == (node_id in self.computing):
            return False
        if computing:
            self.computing.add(node_id)
        else:
            self.computing.discard(node_id)
        return True
