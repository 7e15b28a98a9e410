"""Roles started with only MOONCAKE_* environment variables (no TOML file) form a working
cluster; each answers its health probes (HTTP and `mooncake probe`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from mooncake.testing.api import complete
from mooncake.testing.ports import free_port
from mooncake.testing.wait import wait_for

pytestmark = pytest.mark.timeout(300)


def _env(**values: object) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return {**base, **{f"MOONCAKE_{k.upper()}": str(v) for k, v in values.items()}}


def test_roles_configured_only_by_environment_form_a_cluster(tmp_path, oracle_model, loaded_model):
    http = free_port()
    shared = dict(frontend_port=http, conductor_endpoint=f"tcp://127.0.0.1:{free_port()}",
                  engine_kv_cache_bytes=160 << 20, engine_threads=1, store_dram_bytes=128 << 20,
                  store_lmdb_bytes=256 << 20, store_data_dir=tmp_path / "data", model_device="cpu", model_dtype="float32")
    health = {role: free_port() for role in ("prefill", "decode", "store")}
    procs = {}
    try:
        for role in ("conductor", "store", "prefill", "decode"):
            env = _env(**shared, node_name="envnode", node_health_port=health.get(role, 0))
            procs[role] = subprocess.Popen([sys.executable, "-m", "mooncake.cli", "serve", "--role", role,
                                            "--log-level", "warning"], env=env, start_new_session=True)
        url = f"http://127.0.0.1:{http}"

        def ready() -> bool:
            assert all(p.poll() is None for p in procs.values()), {r: p.returncode for r, p in procs.items()}
            try:
                return httpx.get(url + "/health", timeout=2).json()["nodes"] == {"prefill": 1, "decode": 1, "colocated": 0,
                                                                               "store": 1, "frontend": 1}
            except (httpx.HTTPError, ValueError):
                return False

        wait_for(ready, 240, "the environment-configured roles to register")
        for role, port in health.items():
            r = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5)
            assert r.status_code == 200 and r.json()["role"] == role
        for role in ("conductor", "prefill", "decode", "store"):
            env = _env(frontend_port=http, node_health_port=health.get(role, 0))
            r = subprocess.run([sys.executable, "-m", "mooncake.cli", "probe", "--role", role], env=env,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (role, r.stdout, r.stderr)
        prompt = "The capital of France is"
        ids = loaded_model.tokenizer.encode(prompt)
        with torch.no_grad():
            out = oracle_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        expected = loaded_model.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
        r = complete(url, prompt, max_tokens=16)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
