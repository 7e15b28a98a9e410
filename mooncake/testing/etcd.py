"""A real etcd server for tests (Debian's ``etcd-server``; ``make test`` installs it): its own
free ports and a temporary data directory; it can be killed and started again on the same data."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mooncake.local.cluster import die_with_parent
from mooncake.testing.ports import free_port


class EtcdMissing(RuntimeError):
    """No ``etcd`` binary: install Debian's etcd-server (``make test`` does)."""


class EtcdServer:
    def __init__(self, data_dir: Path | None = None, host: str = "127.0.0.1") -> None:
        """``host``: the address clients reach it on (a test's bridge, for hosts in namespaces)."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing("etcd is not installed (apt-get install etcd-server; make test installs it)")
        self.binary = binary
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="mooncake-etcd-"))
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://{host}:{self.client_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.data_dir), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent)  # never outlives the test run
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd not healthy within {timeout_s:.0f}s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        shutil.rmtree(self.data_dir, ignore_errors=True)


@contextmanager
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
