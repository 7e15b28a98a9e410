"""Free ports for servers a test or benchmark starts later."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()
_PORTS = random.Random(os.getpid())


def free_port(consecutive: int = 1) -> int:
    """A port nothing listens on now (with ``consecutive``, the ports after it too), for a server a
    test starts later.

    Drawn below the kernel's ephemeral range: a port the kernel hands out for ``bind(0)`` can be
    taken, before the server binds it, by any outgoing connection (a CI run failed so: a
    conductor's HTTP port was in use), and two draws from it can return the same port. Never the
    same port twice in one test run."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low = max(low, 20_000)  # a range reaching down this far leaves no port outside it: draw from 10,000 up anyway
    while True:
        port = _PORTS.randrange(10_000, low - consecutive)
        ports = range(port, port + consecutive)
        if any(p in _HANDED_OUT for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
