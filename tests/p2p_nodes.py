"""A P2P cluster for tests on one machine: a conductor and one store per node name, each a
real ``mooncake serve --role`` process on loopback, and the ``mooncake p2p`` command run
as a subprocess with the node's config (started and torn down by the caller)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mooncake.testing.ports import free_port
from mooncake.config import Config
from mooncake.config_toml import dump_toml


class P2PNodes:
    def __init__(self, workdir: Path, names: list[str], store_env: dict[str, dict[str, str]] | None = None,
                 stall_timeout_s: float = 10.0, chunk_bytes: int = 1 << 20) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.names = names
        self.store_env = store_env or {}
        base = Config()
        base.frontend.port = free_port()
        base.conductor.endpoint = f"tcp://127.0.0.1:{free_port()}"
        base.liveness.heartbeat_s, base.liveness.dead_after_s = 0.5, 3.0
        base.liveness.drain_timeout_s = 2.0
        base.store.dram_bytes, base.store.lmdb_bytes = 16 << 20, 0
        base.store.p2p_chunk_bytes, base.store.p2p_stall_timeout_s = chunk_bytes, stall_timeout_s
        base.node.p2p_root = str(self.workdir.parent)  # the tests' trees lie beside the work dir
        self.base = base
        self.procs: dict[str, subprocess.Popen] = {}

    def config(self, name: str) -> Path:
        cfg = self.base.model_copy(deep=True)
        cfg.node.name = name
        cfg.store.data_dir = str(self.workdir / f"data-{name}")
        path = self.workdir / f"{name}.toml"
        path.write_text(dump_toml(cfg))
        return path

    def _spawn(self, key: str, role: str, name: str, env: dict[str, str] | None = None) -> None:
        log = open(self.workdir / f"{key}.log", "ab")
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        self.procs[key] = subprocess.Popen(
            [sys.executable, "-m", "mooncake.cli", "serve", "--role", role, "--config", str(self.config(name)),
             "--log-level", "info"], env={**base_env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()

    def start(self, timeout_s: float = 120.0) -> "P2PNodes":
        self._spawn("conductor", "conductor", "conductor")
        for name in self.names:
            self.start_store(name)
        for name in self.names:
            self.wait_store(name, timeout_s)
        return self

    def start_worker(self, key: str, role: str, name: str, env: dict[str, str] | None = None) -> None:
        """A prefill or decode role on node ``name`` (``env``: MOONCAKE_* overrides), logged as ``key``."""
        self._spawn(key, role, name, env)

    def start_store(self, name: str) -> None:
        self._spawn(name, "store", name, self.store_env.get(name))

    def wait_store(self, name: str, timeout_s: float = 120.0) -> None:
        """Until the conductor knows the store of ``name`` (``p2p ls`` through that node works)."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.procs[name].poll() is None, self.logs()
            r = self.cli(name, "get", "--quiet", "no-such-object", str(self.workdir / "probe"))
            if "no object named" in r.stderr:
                return
            assert time.monotonic() < deadline, f"store {name} never registered: {r.stderr}\n{self.logs()}"
            time.sleep(0.3)

    def cli(self, name: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        return subprocess.run([sys.executable, "-m", "mooncake.cli", "p2p", *args, "--config", str(self.config(name))],
                              capture_output=True, text=True, timeout=timeout_s, env=base_env)

    def popen_cli(self, name: str, *args: str) -> subprocess.Popen:
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        return subprocess.Popen([sys.executable, "-m", "mooncake.cli", "p2p", *args, "--config",
                                 str(self.config(name))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=base_env)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.workdir.glob("*.log")))

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def __enter__(self) -> "P2PNodes":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
