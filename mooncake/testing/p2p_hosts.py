"""P2P peers across network namespaces (``mooncake.testing.hosts``): a conductor on host1 and
a store on every host, CURVE on every link (or plain TCP, ``curve=False``), egress caps set and
changed per host with ``tc``. Used by tests/test_p2p_hosts.py and benchmarks/bench_p2p.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mooncake.config import Config, load_config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.p2p.client import P2PClient
from mooncake.p2p.rpc import P2PError
from mooncake.security import generate_keys
from mooncake.testing.hosts import Hosts

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, for its config.example.toml


class P2PHosts:
    def __init__(self, workdir: Path, n: int = 4, rate: str | None = None, curve: bool = True,
                 stall_timeout_s: float = 20.0, in_flight_per_peer: int | None = None) -> None:
        self.workdir = Path(workdir)
        base = load_config(SOURCE_ROOT / "config.example.toml", env={})  # fixed ports: each host has its own stack
        base.store.dram_bytes, base.store.lmdb_bytes = 16 << 20, 0
        base.store.p2p_stall_timeout_s = stall_timeout_s
        base.node.p2p_root = str(self.workdir.parent)  # the tests' trees lie beside the work dir
        if in_flight_per_peer is not None:
            base.store.p2p_in_flight_per_peer = in_flight_per_peer
        base.liveness.heartbeat_s, base.liveness.dead_after_s, base.liveness.drain_timeout_s = 0.5, 4.0, 2.0
        resolve_model_dir(base.model)  # the conductor's tokenizer: converted once, before it starts
        if curve:
            generate_keys(self.workdir / "keys")
            base.security.curve_keys_dir = str(self.workdir / "keys")
        else:
            base.security.allow_insecure_network = True
        self.hosts = Hosts(n, self.workdir, rate)
        self.n = n
        self.configs: dict[int, Config] = {}
        try:
            for i in range(1, n + 1):
                cfg = self.hosts.config_for(base, i)
                cfg.store.data_dir = str(self.workdir / f"data{i}")
                self.configs[i] = cfg
                if i == 1:
                    self.hosts.spawn(1, "conductor", cfg)
                self.hosts.spawn(i, "store", cfg, log_level="info")
            for i in range(1, n + 1):
                self.wait_store(i)
        except BaseException:
            self.close()
            raise

    def client(self, i: int) -> P2PClient:
        """A client acting through host ``i``'s store (from the root namespace, over the bridge)."""
        return P2PClient(self.configs[i])

    def wait_store(self, i: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s

        async def found() -> bool:
            c = self.client(i)
            try:
                await c.store()
                return True
            except P2PError:
                return False
            finally:
                c.close()

        while not asyncio.run(found()):
            procs = [p for h in self.hosts.hosts for p in h.procs.values()]
            assert all(p.poll() is None for p in procs), self.hosts.logs()
            assert time.monotonic() < deadline, f"host{i}'s store never registered\n{self.hosts.logs()}"
            time.sleep(0.3)

    def cli(self, i: int, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """``mooncake p2p ARGS`` run inside host ``i`` with that host's store config."""
        cmd = ["ip", "netns", "exec", self.hosts[i].ns, sys.executable, "-m", "mooncake.cli", "p2p", *args,
               "--config", str(self.workdir / f"host{i}-store.toml")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)

    def set_rate(self, i: int, rate: str | None) -> None:
        """Cap host ``i``'s egress at ``rate`` (tc tbf), or lift the cap (None)."""
        ns = self.hosts[i].ns
        if rate is None:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True)
            return
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                        rate, "burst", "256kb", "latency", "100ms"], check=True, capture_output=True)

    def kill_store(self, i: int) -> None:
        proc = self.hosts[i].procs["store"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        self.hosts.close()

    def __enter__(self) -> "P2PHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
