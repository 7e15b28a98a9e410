"""``mooncake serve --dev``: a whole cluster on this machine, one OS process per role.

The children run exactly what ``mooncake serve --role ROLE --config FILE`` runs;
they talk over an ``ipc://`` conductor socket in a private temporary directory
and TCP ports chosen by the OS. Instance ``i`` of each role is placed on node
``node<i>``, so locality (a prefill instance's local store) means the same thing
as on a real cluster. Ctrl-C or SIGTERM stops every child.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from mooncake.config import Config, dump_toml
from mooncake.engine.loader import resolve_model_dir

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM when this process dies, however it
    dies (SIGKILL included), so that no role outlives ``mooncake serve --dev`` holding its ports."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


class DevCluster:
    def __init__(self, cfg: Config, prefill: int = 1, decode: int = 1, store: int = 1,
                 log_level: str = "warning") -> None:
        self.cfg = cfg.model_copy(deep=True)
        self.counts = {"prefill": prefill, "decode": decode, "store": store}
        self.log_level = log_level
        self.tmp = Path(tempfile.mkdtemp(prefix="mooncake-dev-"))
        self.cfg.conductor.endpoint = f"ipc://{self.tmp}/conductor"
        self.children: dict[str, subprocess.Popen] = {}
        self.url = f"http://{self.cfg.conductor.host}:{self.cfg.conductor.port}"

    def spawn(self, role: str, index: int = 0, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start (or restart) one role process (``env``: variables added to its environment)."""
        name = f"{role}{index}" if role != "conductor" else "conductor"
        path = self.tmp / f"{name}.toml"
        cfg = self.cfg.model_copy(deep=True)
        cfg.node.name = f"node{index}"
        cfg.node.node_id = "" if role == "conductor" else f"node{index}-{role}"
        path.write_text(dump_toml(cfg))
        cmd = [sys.executable, "-m", "mooncake.cli", "serve", "--role", role, "--config", str(path),
               "--log-level", self.log_level]
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,
                                env={**os.environ, **env} if env else None)
        self.children[name] = proc
        return proc

    def start(self, timeout_s: float = 180.0) -> None:
        resolve_model_dir(self.cfg.model)  # convert the model once, before the children race for it
        self.spawn("conductor")
        for role in ("store", "prefill", "decode"):
            for i in range(self.counts[role]):
                self.spawn(role, i)
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float, want: dict[str, int] | None = None) -> None:
        want = want or self.counts
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.children.items():
                if proc.poll() is not None and name == "conductor":
                    raise RuntimeError(f"the conductor exited with code {proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    import json

                    nodes = json.loads(r.read())["nodes"]
                    if all(nodes.get(k, 0) >= v for k, v in want.items()):
                        return
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"cluster not ready within {timeout_s:.0f}s")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.children[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every role — all at once, so that each drains its own in-flight work
        (the conductor its HTTP responses, workers their sequences) — then SIGKILL what
        is still running after the drain timeout (plus a margin)."""
        grace_s = self.cfg.conductor.drain_timeout_s + 10 if grace_s is None else grace_s
        for proc in self.children.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_dev(cfg: Config, prefill: int, decode: int, store: int, log_level: str) -> int:
    cluster = DevCluster(cfg, prefill, decode, store, log_level)
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    t0 = time.monotonic()
    try:
        cluster.start()
        print(f"mooncake ready at {cluster.url} in {time.monotonic() - t0:.1f}s "
              f"({prefill} prefill, {decode} decode, {store} store)", flush=True)
        while not stopping:
            if cluster.children["conductor"].poll() is not None:
                print("the conductor exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"mooncake: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
