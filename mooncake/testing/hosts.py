"""A harness of hosts for tests and benchmarks: network namespaces on a bridge, each with its own
private address (10.213.X.i/24) and optionally an egress rate cap (``tc tbf``), and
mooncake roles run inside them with ``ip netns exec`` from per-host config files.

Everything it creates — processes, namespaces, veth pairs, the bridge — is removed
by ``close()`` whatever happened before (use it as a context manager), and stale
leftovers of a killed test run (their creator pid is gone) are swept on start.
Names carry the creator's pid: namespaces ``mcnh<pid>-h<i>``, bridge ``mcbr<pid>``,
veths ``mcv<pid>h<i>`` (interface names stay under 16 characters).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mooncake.config import Config
from mooncake.config_toml import dump_toml

NS_PREFIX = "mcnh"
BRIDGE_PREFIX = "mcbr"
VETH_PREFIX = "mcv"


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no kernel support)."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


def unavailable_reason() -> str:
    """Why the harness cannot run here, or "" when it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _namespaces() -> list[str]:
    """Names from ``ip netns list`` (lines look like ``name`` or ``name (id: 3)``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Remove namespaces and links left by harness runs whose process is gone."""
    for name in _namespaces():
        m = re.match(rf"^{NS_PREFIX}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines():
        m = re.match(rf"^\d+: ((?:{BRIDGE_PREFIX}|{VETH_PREFIX})(\d+)\w*)[@:]", line)
        if m and not _pid_alive(int(m.group(2))):
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True)


def _kill_namespace_processes(ns: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal a spawned role's process group (``ip netns exec`` execs into the role)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _free_subnet() -> int:
    """A third octet X such that 10.213.X.0/24 is routed nowhere on this machine."""
    used = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    start = os.getpid() % 200
    for k in range(250):
        x = (start + k) % 250 + 1
        if f"10.213.{x}." not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/24 subnet")


@dataclass
class Host:
    index: int
    ns: str
    address: str
    veth: str  # the bridge-side end, in the root namespace
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)


class Hosts:
    """``n`` hosts ``host1..hostN`` at 10.213.X.1..N; the root namespace is 10.213.X.254."""

    def __init__(self, n: int, workdir: Path, rate: str | None = None) -> None:
        reason = unavailable_reason()
        if reason:
            raise HostsUnavailable(reason)
        sweep_stale()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        self.subnet = _free_subnet()
        self.bridge = f"{BRIDGE_PREFIX}{pid}"
        self.gateway = f"10.213.{self.subnet}.254"
        self.hosts: list[Host] = []
        try:
            _ip("ip", "link", "add", self.bridge, "type", "bridge")
            _ip("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("ip", "link", "set", self.bridge, "up")
            for i in range(1, n + 1):
                self._add_host(i, pid, rate)
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int, pid: int, rate: str | None) -> None:
        host = Host(i, f"{NS_PREFIX}{pid}-h{i}", f"10.213.{self.subnet}.{i}", f"{VETH_PREFIX}{pid}h{i}")
        self.hosts.append(host)
        _ip("ip", "netns", "add", host.ns)
        _ip("ip", "link", "add", host.veth, "type", "veth", "peer", "name", f"{host.veth}p")
        _ip("ip", "link", "set", f"{host.veth}p", "netns", host.ns)
        _ip("ip", "link", "set", f"{host.veth}p", "name", "eth0", ns=host.ns)
        _ip("ip", "addr", "add", f"{host.address}/24", "dev", "eth0", ns=host.ns)
        _ip("ip", "link", "set", "eth0", "up", ns=host.ns)
        _ip("ip", "link", "set", "lo", "up", ns=host.ns)
        _ip("ip", "link", "set", host.veth, "master", self.bridge)
        _ip("ip", "link", "set", host.veth, "up")
        if rate:
            _ip("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "256kb",
                "latency", "100ms", ns=host.ns)

    def __getitem__(self, i: int) -> Host:
        """Host ``i`` (1-based, as in host1)."""
        return self.hosts[i - 1]

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- links

    def link(self, i: int, up: bool) -> None:
        """Cut host ``i`` off the bridge (its bridge-side veth down), or reconnect it."""
        _ip("ip", "link", "set", self[i].veth, "up" if up else "down")

    # ---- processes

    def config_for(self, base: Config, i: int, conductor_host: int = 1) -> Config:
        """``base`` with the per-host keys: node name/host and the conductor's address."""
        cfg = base.model_copy(deep=True)
        cfg.node.name, cfg.node.host = f"host{i}", self[i].address
        conductor = self[conductor_host].address
        port = cfg.conductor.endpoint.rsplit(":", 1)[1]
        cfg.conductor.endpoint = f"tcp://{conductor}:{port}"
        cfg.frontend.host = conductor
        return cfg

    def spawn(self, i: int, role: str, cfg: Config | None = None, env: dict[str, str] | None = None,
              log_level: str = "warning") -> subprocess.Popen:
        """Run ``mooncake serve --role ROLE`` inside host ``i``: from ``cfg`` written to a
        TOML file, and/or from ``env`` (MOONCAKE_* variables) alone."""
        host = self[i]
        cmd = ["ip", "netns", "exec", host.ns, sys.executable, "-m", "mooncake.cli", "serve", "--role", role,
               "--log-level", log_level]
        if cfg is not None:
            path = self.workdir / f"host{i}-{role}.toml"
            path.write_text(dump_toml(cfg))
            cmd += ["--config", str(path)]
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
        log = open(self.workdir / f"host{i}-{role}.log", "ab")
        proc = subprocess.Popen(cmd, env={**base_env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        host.procs[role] = proc
        return proc

    def wait_registered(self, url: str, nodes: dict[str, int], what: str, timeout_s: float = 240) -> None:
        """Until ``url``'s ``/health`` counts ``nodes`` (role -> live instances); fails at once, with
        the logs, if a role process died meanwhile."""
        import httpx

        from mooncake.testing.wait import wait_for

        def ready() -> bool:
            assert all(p.poll() is None for host in self.hosts for p in host.procs.values()), self.logs()
            try:
                return httpx.get(url + "/health", timeout=2).json()["nodes"] == nodes
            except (httpx.HTTPError, ValueError):
                return False

        wait_for(ready, timeout_s, what)

    def logs(self) -> str:
        """The tail of every role's log (for assertion messages)."""
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
                         for p in sorted(self.workdir.glob("*.log")))

    def stop_processes(self, grace_s: float = 10.0) -> None:
        """SIGTERM every role (they drain), SIGKILL what is left after ``grace_s``; never raises."""
        procs = [p for h in self.hosts for p in h.procs.values()]
        for p in procs:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass  # the namespace sweep in close() kills it

    def close(self) -> None:
        """Stop every process, delete every namespace, veth and the bridge (idempotent)."""
        try:
            self.stop_processes()
        finally:
            for host in self.hosts:
                _kill_namespace_processes(host.ns)  # anything else started inside
                subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
                subprocess.run(["ip", "link", "del", host.veth], capture_output=True)  # gone with its peer
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self.hosts = []


def leftovers(pid: int | None = None) -> list[str]:
    """Namespaces and links of the harness (of ``pid``'s run, default this process) still present."""
    tag = str(pid or os.getpid())
    names = _namespaces()
    links = re.findall(r"^\d+: ([^:@]+)", subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                                         text=True).stdout, re.M)
    return [n for n in names if n.startswith(f"{NS_PREFIX}{tag}-")] + \
        [n for n in links if n.startswith((f"{BRIDGE_PREFIX}{tag}", f"{VETH_PREFIX}{tag}h"))]
