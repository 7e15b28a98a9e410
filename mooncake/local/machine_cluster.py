"""``mooncake serve``: a whole cluster on this machine, one OS process per role.

The children run exactly what ``mooncake serve --role ROLE --config FILE`` runs;
they talk over an ``ipc://`` conductor socket in a private temporary directory
and TCP ports chosen by the OS. Instance ``i`` of each role is placed on node
``node<i>``, so locality (a prefill instance's local store) means the same thing
as on a real cluster. Their output is forwarded line by line, each line naming the
role that wrote it. ``run_local`` supervises them (``mooncake.local.supervisor``); Ctrl-C or
SIGTERM stops every child.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from mooncake.config import Config
from mooncake.config_toml import dump_toml
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.logs import log_format, role_tag, tag_logs
from mooncake.protocol.membership import ENGINE_ROLES

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# How long an engine's OpenMP workers spin after a parallel region before they sleep, where engines
# share cores (libgomp's default is 300,000 iterations, a good part of a millisecond).
SHARED_CORES_SPIN = "1000"


def die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when this process dies, however it
    dies (SIGKILL included), so that no role outlives ``mooncake serve --dev`` holding its ports."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


class LocalCluster:
    def __init__(self, cfg: Config, prefill: int = 1, decode: int = 1, store: int = 1,
                 log_level: str = "warning", frontends: int = 1, conductors: int = 1, colocated: int = 0) -> None:
        """``frontends``: one runs in the conductor's process; more run as processes of their own,
        on ``[frontend] port``, port + 1, ...; ``urls`` lists where each serves. ``conductors`` > 1
        (``[coordination]`` set): conductors ``conductor0``... on sockets of their own, one leads,
        and every frontend is a process of its own."""
        self.cfg = cfg.model_copy(deep=True)
        self.counts = {"prefill": prefill, "decode": decode, "colocated": colocated, "store": store,
                       "frontend": frontends}
        self.conductors = conductors
        self.own_frontends = frontends > 1 or conductors > 1
        self.log_level = log_level
        self.tmp = Path(tempfile.mkdtemp(prefix="mooncake-dev-"))
        self.cfg.conductor.endpoint = f"ipc://{self.tmp}/conductor"
        self.children: dict[str, subprocess.Popen] = {}
        f = self.cfg.frontend
        self.urls = [f"http://{f.host}:{f.port + i}" for i in range(frontends)]
        self.url = self.urls[0]

    def spawn(self, role: str, index: int = 0, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start (or restart) one role process (``env``: variables added to its environment)."""
        name = f"{role}{index}" if role != "conductor" or self.conductors > 1 else "conductor"
        path = self.tmp / f"{name}.toml"
        cfg = self.cfg.model_copy(deep=True)
        cfg.node.name = f"node{index}"
        cfg.node.node_id = "" if role == "conductor" else f"node{index}-{role}"
        cfg.conductor.frontend = "off" if self.own_frontends else "on"
        if role == "conductor" and self.conductors > 1:
            cfg.conductor.endpoint = f"ipc://{self.tmp}/conductor{index}"
        if role == "frontend":
            cfg.frontend.port += index
        path.write_text(dump_toml(cfg))
        cmd = [sys.executable, "-m", "mooncake.cli", "serve", "--role", role, "--config", str(path),
               "--log-level", self.log_level]
        env = {**self.engine_env(role), **(env or {})}
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent,
                                env={**os.environ, **env} if env else None,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        tag = role_tag(role, cfg.node.node_id or cfg.node.name)
        threading.Thread(target=_forward, args=(proc, tag), name=f"output-{name}", daemon=True).start()
        self.children[name] = proc
        return proc

    def engine_env(self, role: str) -> dict[str, str]:
        """What an engine process's environment gets when the engines' threads outnumber this
        machine's cores: its OpenMP workers sleep soon after each parallel region rather than spin
        for the next (``GOMP_SPINCOUNT``), so one engine's idle workers do not take the cores
        another computes on. Engines with cores enough for their threads keep libgomp's spinning,
        which a decode step's few hundred short regions need (``roles/torch_threads.py``). Set
        either variable yourself to override."""
        cpus = len(os.sched_getaffinity(0))
        threads = sum(self.counts[r] for r in ENGINE_ROLES) * (self.cfg.engine.threads or cpus)
        if role not in ENGINE_ROLES or threads <= cpus or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ):
            return {}
        return {"GOMP_SPINCOUNT": SHARED_CORES_SPIN}

    def launch(self) -> None:
        """Start every role, without waiting for them."""
        resolve_model_dir(self.cfg.model)  # convert the model once, before the children race for it
        for i in range(self.conductors):
            self.spawn("conductor", i)
        for role in ("frontend",) * self.own_frontends + ("store", "prefill", "decode", "colocated"):
            for i in range(self.counts[role]):
                self.spawn(role, i)

    def start(self, timeout_s: float = 180.0) -> None:
        self.launch()
        self.wait_ready(timeout_s)

    def ready(self, want: dict[str, int] | None = None) -> bool:
        """Whether every role has registered with the conductor (``want``: counts per role)."""
        want = want or self.counts
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                nodes = json.loads(r.read())["nodes"]
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            return False
        return all(nodes.get(k, 0) >= v for k, v in want.items())

    def wait_ready(self, timeout_s: float, want: dict[str, int] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            conductors = [p for name, p in self.children.items() if name.startswith("conductor")]
            if all(p.poll() is not None for p in conductors):
                raise RuntimeError(f"the conductor exited with code {conductors[0].returncode}")
            if self.ready(want):
                return
            time.sleep(0.25)
        raise TimeoutError(f"cluster not ready within {timeout_s:.0f}s")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.children[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every role so that each drains its own in-flight work (the frontends their HTTP
        responses, workers their sequences and their writes to the stores) — the stores last, once
        the rest have exited, so that no write-back finds its store gone — then SIGKILL what is
        still running after the drain timeout (plus a margin)."""
        grace_s = self.cfg.liveness.drain_timeout_s + 10 if grace_s is None else grace_s
        deadline = time.monotonic() + grace_s
        stores = [n for n in self.children if n.startswith("store")]
        for wave in ([n for n in self.children if n not in stores], stores):
            for name in wave:
                if self.children[name].poll() is None:
                    try:
                        os.killpg(self.children[name].pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for name in wave:
                proc = self.children[name]
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _forward(proc: subprocess.Popen, tag: str) -> None:
    """Copy a child's output to ours line by line, naming the role on each line that does not
    already (a traceback, a library's print): ``[prefill:node0-prefill] ...``, or in JSON mode
    a ``{"role", "instance", "message"}`` object."""
    as_json = log_format() == "json"
    role, instance = tag.split(":", 1)
    for raw in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
        line = raw.decode(errors="replace").rstrip("\n")
        if as_json and not line.startswith("{"):
            line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "level": "INFO",
                               "role": role, "instance": instance, "message": line})
        elif not as_json and f"[{tag}]" not in line:
            line = f"[{tag}] {line}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    proc.stdout.close()  # type: ignore[union-attr]


def run_local(cfg: Config, prefill: int, decode: int, store: int, log_level: str, frontends: int = 1,
              colocated: int = 0) -> int:
    """``mooncake serve``: start the cluster, say where it serves once every role has registered,
    restart a role that dies, stop everything on Ctrl-C or SIGTERM."""
    from mooncake.local.supervisor import GaveUp, Supervisor

    tag_logs("supervisor", cfg.node.name, quiet_libraries=False)  # a GGUF's conversion shows its progress
    cluster = LocalCluster(cfg, prefill, decode, store, log_level, frontends, colocated=colocated)
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t0 = time.monotonic()
    try:
        cluster.launch()
        supervisor = Supervisor(cluster)
        announced = False
        while not stopping:
            supervisor.check()
            if not announced and time.monotonic() - t0 > 600:
                raise TimeoutError("the roles did not all register within 600 s")
            if not announced and cluster.ready():
                print(ready_banner(cluster, time.monotonic() - t0), flush=True)
                announced = True
            time.sleep(0.25)
        return 0
    except (GaveUp, TimeoutError) as e:
        print(f"mooncake: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()


def ready_banner(cluster: LocalCluster, seconds: float) -> str:
    """The first line a user reads: where to send requests, and how to stop."""
    counts = ", ".join(f"{n} {role}" for role, n in cluster.counts.items() if n)
    at = " and ".join(f"{url}/v1" for url in cluster.urls)
    return (f"mooncake ready in {seconds:.0f}s ({counts}): OpenAI API at {at} "
            f"(try: curl {cluster.url}/v1/models); Ctrl-C stops it")
