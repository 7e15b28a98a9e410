"""Real etcd for tests (Debian's ``etcd-server``; ``make test`` installs it): one server
(``EtcdServer``) or a cluster of three members (``EtcdCluster``), each on its own free ports and
temporary data directory, each killed and started again on the same data; and ``FailingProxy``, an
HTTP proxy in front of one member's client URL that can be switched to answer errors."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

from mooncake.local.machine_cluster import die_with_parent
from mooncake.testing.ports import free_port


CLIENT_SERVICES = re.compile(r'grpc_service="(etcdserverpb\.(Lease|KV|Watch)|v3electionpb\.Election)"')


class EtcdMissing(RuntimeError):
    """No ``etcd`` binary: install Debian's etcd-server (``make test`` does)."""


class EtcdServer:
    def __init__(self, data_dir: Path | None = None, host: str = "127.0.0.1", name: str = "test") -> None:
        """``host``: the address clients reach it on (a test's bridge, for hosts in namespaces);
        ``name``: its member name (``initial_cluster`` names its peers, for a cluster)."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdMissing("etcd is not installed (apt-get install etcd-server; make test installs it)")
        self.binary, self.name = binary, name
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="mooncake-etcd-"))
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://{host}:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.initial_cluster = f"{name}={self.peer_url}"
        self.proc: subprocess.Popen | None = None

    def launch(self) -> None:
        """Start the process, without waiting (a cluster's members wait for each other)."""
        peer = self.peer_url
        self.proc = subprocess.Popen(
            [self.binary, "--name", self.name, "--data-dir", str(self.data_dir), "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", self.initial_cluster, "--initial-cluster-token", "mooncake-test"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent)  # never outlives the test run

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until it answers healthy (a member of a cluster: once the cluster has a leader)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd {self.name} exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd {self.name} not healthy within {timeout_s:.0f}s")

    def start(self, timeout_s: float = 30.0) -> None:
        self.launch()
        self.wait_healthy(timeout_s)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def status(self) -> dict:
        """etcd's ``/v3/maintenance/status`` of this member (``leader``: the raft leader's member
        id; ``header.member_id``: this member's)."""
        req = urllib.request.Request(self.url + "/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=2) as r:
            return json.loads(r.read())

    def calls(self) -> int:
        """How many client calls (leases, elections, keys) this member has taken since it started."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=2) as r:
            text = r.read().decode()
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("grpc_server_started_total{") and CLIENT_SERVICES.search(line))


@contextmanager
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


class EtcdCluster:
    """``size`` real etcd members that know each other (``--initial-cluster`` of all); ``urls``
    their client URLs, for ``etcd_endpoints``. Stop it always (``etcd_cluster()`` does)."""

    def __init__(self, size: int = 3) -> None:
        self.members = [EtcdServer(name=f"member{i}") for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every member not running; until each is healthy (the cluster has a leader)."""
        started = [m for m in self.members if not m.running()]
        for m in started:
            m.launch()
        for m in started:
            m.wait_healthy(timeout_s)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.members[i].kill(sig)

    def restart(self, i: int, timeout_s: float = 60.0) -> None:
        """Start member ``i`` again on its data (it rejoins the cluster)."""
        self.members[i].kill()
        self.members[i].start(timeout_s)

    def leader(self) -> int:
        """The raft leader: the index of the member that the running members name leader
        (etcd's ``/v3/maintenance/status``)."""
        statuses = {i: m.status() for i, m in enumerate(self.members) if m.running()}
        ids = {int(s["header"]["member_id"]): i for i, s in statuses.items()}
        named = {int(s.get("leader", 0)) for s in statuses.values()}
        if len(named) != 1 or next(iter(named)) not in ids:
            raise RuntimeError(f"the running members name no one leader among them: {statuses}")
        return ids[named.pop()]

    def move_leader(self, to: int, timeout_s: float = 10.0) -> None:
        """Make member ``to`` the raft leader (etcd's leadership transfer, asked of the leader)."""
        deadline = time.monotonic() + timeout_s
        while (now := self.leader()) != to:
            if time.monotonic() > deadline:
                raise TimeoutError(f"member {to} did not become the raft leader")
            target = self.members[to].status()["header"]["member_id"]
            req = urllib.request.Request(self.members[now].url + "/v3/maintenance/transfer-leadership",
                                         data=json.dumps({"targetID": target}).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()

    def busiest(self, seconds: float = 1.0) -> tuple[int, int]:
        """The running member that took the most client calls over the next ``seconds`` (the one
        clients ask first), and how many it took."""
        running = [i for i, m in enumerate(self.members) if m.running()]
        before = {i: self.members[i].calls() for i in running}
        time.sleep(seconds)
        took = {i: self.members[i].calls() - before[i] for i in running}
        i = max(took, key=took.__getitem__)
        return i, took[i]

    def followers(self) -> list[int]:
        leader = self.leader()
        return [i for i, m in enumerate(self.members) if m.running() and i != leader]

    def stop(self) -> None:
        for m in self.members:
            m.stop()


@contextmanager
def etcd_cluster(size: int = 3) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class FailingProxy:
    """An HTTP proxy in front of ``target`` (an etcd client URL) on a free port (``url``): it
    passes every request on, or, after ``fail()``, answers each new one ``status`` with ``body``
    until ``heal()``. Close it always."""

    def __init__(self, target: str, status: int = 503,
                 body: str = '{"error": "etcdserver: request timed out", "code": 14}') -> None:
        self.target = urllib.parse.urlsplit(target)
        self.status, self.body = status, body
        self.failing = threading.Event()
        self.passed = self.refused = 0  # requests passed on, and answered with the error
        self._count = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sent = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                failing = proxy.failing.is_set()
                with proxy._count:
                    proxy.refused += failing
                    proxy.passed += not failing
                if failing:
                    status, body = proxy.status, proxy.body.encode()
                else:
                    status, body = proxy.forward(self.command, self.path, sent)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """The target's answer (a member that cannot be reached: 502, as a gateway answers)."""
        conn = http.client.HTTPConnection(self.target.hostname, self.target.port, timeout=60)
        try:
            conn.request(method, path, body=body or None, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        except OSError as e:
            return 502, json.dumps({"error": f"proxy: {e}"}).encode()
        finally:
            conn.close()

    def fail(self) -> None:
        self.failing.set()

    def heal(self) -> None:
        self.failing.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
