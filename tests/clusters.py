"""Helpers for tests that run real clusters: free ports, small configs, metric parsing."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx

from mooncake.config import Config, MiB
from mooncake.dev import DevCluster

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_config(data_dir: Path, **conductor: object) -> Config:
    """A config sized for tests on a 2-core machine: small pools, one torch thread per role."""
    cfg = Config()
    cfg.conductor.port = free_port()
    for k, v in conductor.items():
        setattr(cfg.conductor, k, v)
    cfg.engine.kv_cache_bytes = 160 * MiB
    cfg.engine.threads = 1
    cfg.store.dram_bytes = 128 * MiB
    cfg.store.lmdb_bytes = 256 * MiB
    cfg.store.data_dir = str(data_dir)
    return cfg


def start_cluster(data_dir: Path, prefill: int = 1, decode: int = 1, store: int = 1, **conductor: object) -> DevCluster:
    cluster = DevCluster(small_config(data_dir, **conductor), prefill, decode, store)
    try:
        cluster.start(timeout_s=240)
    except BaseException:
        cluster.stop()
        raise
    return cluster


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
