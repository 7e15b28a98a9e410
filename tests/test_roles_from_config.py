"""Each role started on its own with ``mooncake serve --role R --config config.example.toml``
forms a working cluster (ports and data dir moved to free/temporary ones)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mooncake.config import load_config
from mooncake.config_toml import example_toml
from mooncake.testing.api import complete
from mooncake.testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def test_example_config_is_current_and_valid():
    text = (ROOT / "config.example.toml").read_text()
    assert text == example_toml(), "regenerate config.example.toml (command in its header)"
    load_config(ROOT / "config.example.toml")


def test_roles_started_one_by_one_form_a_cluster(tmp_path):
    text = (ROOT / "config.example.toml").read_text()
    http, zmq_port = free_port(), free_port()
    text = (text.replace("port = 8000", f"port = {http}")
            .replace("tcp://127.0.0.1:5550", f"tcp://127.0.0.1:{zmq_port}")
            .replace('data_dir = "./mooncake-data"', f'data_dir = "{tmp_path}/data"')
            .replace("kv_cache_bytes = 1073741824", "kv_cache_bytes = 167772160"))
    cfg_path = tmp_path / "cluster.toml"
    cfg_path.write_text(text)
    procs = [subprocess.Popen([sys.executable, "-m", "mooncake.cli", "serve", "--role", role,
                               "--config", str(cfg_path), "--log-level", "warning"], start_new_session=True)
             for role in ("conductor", "store", "prefill", "decode")]
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                h = httpx.get(url + "/health", timeout=2)
                if h.status_code == 200 and h.json()["nodes"]["store"] == 1:
                    break
            except httpx.HTTPError:
                pass
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            time.sleep(0.5)
        r = complete(url, "The sky is", max_tokens=6)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
