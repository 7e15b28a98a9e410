"""Helpers for tests that run real clusters: the one way to start one, small configs, the
one SSE parser, metric parsing, waiting on conditions."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import httpx

from mooncake.config import Config, MiB
from mooncake.dev import DevCluster

MODEL = "SmolLM2-135M-Instruct"


_HANDED_OUT: set[int] = set()
_PORTS = random.Random(os.getpid())


def free_port() -> int:
    """A port nothing listens on now, for a server a test starts later.

    Drawn below the kernel's ephemeral range: a port the kernel hands out for ``bind(0)`` can be
    taken, before the server binds it, by any outgoing connection (a CI run failed so: a
    conductor's HTTP port was in use), and two draws from it can return the same port. Never the
    same port twice in one test run."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low = max(low, 20_000)  # a range reaching down this far leaves no port outside it: draw from 10,000 up anyway
    while True:
        port = _PORTS.randrange(10_000, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def small_config(data_dir: Path, **conductor: object) -> Config:
    """A config sized for tests on a 2-core machine: small pools, one torch thread per role,
    float32 (outputs are compared with transformers token for token)."""
    cfg = Config()
    cfg.model.dtype = "float32"
    cfg.conductor.port = free_port()
    for k, v in conductor.items():
        setattr(cfg.conductor, k, v)
    cfg.engine.kv_cache_bytes = 160 * MiB
    cfg.engine.threads = 1
    cfg.engine.profile_at_start = False  # a few seconds per role; the admission tests turn it on
    cfg.store.dram_bytes = 128 * MiB
    cfg.store.lmdb_bytes = 256 * MiB
    cfg.store.data_dir = str(data_dir)
    return cfg


def start_cluster(data_dir: Path | None = None, prefill: int = 1, decode: int = 1, store: int = 1,
                  cfg: Config | None = None, **conductor: object) -> DevCluster:
    """A started dev cluster (the caller stops it): ``cfg``, or ``small_config(data_dir, **conductor)``."""
    if cfg is None:
        assert data_dir is not None
        cfg = small_config(data_dir, **conductor)
    cluster = DevCluster(cfg, prefill, decode, store)
    try:
        cluster.start(timeout_s=240)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def running_cluster(*args: object, **kw: object) -> Iterator[DevCluster]:
    """``start_cluster`` for a ``with`` block: the cluster is always stopped."""
    cluster = start_cluster(*args, **kw)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()


def start_store_process(data_dir: Path | str, *args: str, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """A standalone store server (``python -m mooncake.tiers.server``) on a free port:
    (process, endpoint). The caller stops it."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.tiers.server", "--endpoint", "tcp://127.0.0.1:0",
                             "--data-dir", str(data_dir), *args], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line or not line[0].startswith("READY "):
        proc.kill()
        raise RuntimeError(f"store did not start: {line} {proc.communicate()[1][-2000:]}")
    return proc, line[0].split()[1]


@contextmanager
def store_process(data_dir: Path | str, *args: str, timeout: float = 60.0) -> Iterator[str]:
    """A standalone store server on a free port; yields its endpoint; always torn down."""
    proc, endpoint = start_store_process(data_dir, *args, timeout=timeout)
    try:
        yield endpoint
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def sse_events(lines: Iterable[str]) -> list:
    """The events of an SSE body (its lines): parsed JSON objects, and "[DONE]"."""
    events: list = []
    for line in lines:
        if not line.strip():
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream(url: str, body: dict, on_event: Callable[[int, object], bool | None] | None = None,
           path: str = "/v1/completions", headers: dict | None = None, timeout: float = 120) -> list:
    """POST a streaming request and parse its events as they come; ``on_event(n, event)`` is
    called after the n-th event (1-based) and stops reading when it returns True."""
    events: list = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.strip():
                continue
            events += sse_events([line])
            if on_event is not None and on_event(len(events), events[-1]):
                break
    return events


def stream_text(events: list) -> str:
    return "".join(e["choices"][0].get("text", "") or e["choices"][0].get("delta", {}).get("content", "") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def complete(url: str, prompt: object, max_tokens: int = 16, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
