"""``[model] p2p_name`` end to end: a prefill and a decode role whose model directory is
missing fetch it from a peer (the converted safetensors directory, published by another
node's store) through their node's store, then serve; greedy output matches transformers.

Both workers start at once on the same node, into the same directory: the second must wait
for the first one's fetch (its files exist at full size before their chunks are in), never
load a half-written model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch

from mooncake.config import MiB
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.testing.api import MODEL

from p2p_nodes import P2PNodes

pytestmark = pytest.mark.timeout(400)


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def wait_workers(url: str, nodes: P2PNodes, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for key in ("n2-prefill", "n2-decode"):
            assert nodes.procs[key].poll() is None, f"{key} exited\n{nodes.logs()}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                have = json.loads(r.read())["nodes"]
            if have.get("prefill", 0) >= 1 and have.get("decode", 0) >= 1:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the workers never registered\n{nodes.logs()}")


def test_workers_fetch_their_missing_model_from_a_peer_and_serve_it(tmp_path, oracle_model, loaded_model):
    nodes = P2PNodes(tmp_path / "cluster", ["n1", "n2"], chunk_bytes=16 << 20)
    cfg = nodes.base
    cfg.model.dtype, cfg.model.name = "float32", MODEL
    cfg.engine.kv_cache_bytes, cfg.engine.threads, cfg.engine.profile_at_start = 64 * MiB, 1, False
    model_dir, _ = resolve_model_dir(cfg.model)  # what the conductor reads; n1 publishes a copy under p2p_root
    published = tmp_path / "published"
    try:
        shutil.copytree(model_dir, published, copy_function=os.link)
    except OSError:  # another filesystem
        shutil.rmtree(published, ignore_errors=True)
        shutil.copytree(model_dir, published)
    dest = tmp_path / "models" / "smol"
    with nodes:
        r = nodes.cli("n1", "put", "smol", str(published))
        assert r.returncode == 0, r.stderr
        env = {"MOONCAKE_MODEL_PATH": str(dest), "MOONCAKE_MODEL_P2P_NAME": "smol"}
        nodes.start_worker("n2-prefill", "prefill", "n2", env)
        nodes.start_worker("n2-decode", "decode", "n2", env)
        url = f"http://127.0.0.1:{cfg.frontend.port}"
        wait_workers(url, nodes)

        assert digests(dest) == digests(model_dir)
        listing = nodes.cli("n1", "ls").stdout
        assert "n1 complete, n2 complete" in listing, listing
        prompt = "The capital of France is"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        got = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, got.text
        ids = loaded_model.tokenizer.encode(prompt)
        with torch.no_grad():
            out = oracle_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        assert got.json()["choices"][0]["text"] == loaded_model.tokenizer.decode(out[0, len(ids):].tolist(),
                                                                             skip_special_tokens=True)
