"""Attacks on a CURVE cluster bound to a non-loopback address, and the refusal to run off
loopback without keys.

The address is an extra /32 on ``lo`` (10.219.X.1, X from the test's pid), added for
this module and always removed: the roles bind and connect to it as to any routable
address (needs root, skipped otherwise). Each attack is refused, and the cluster keeps
serving greedy output equal to transformers float32.

Shapes: the pair only: it has the most links (the KV link among them) to attack."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest
import torch
import zmq

from mooncake import protocol as P
from mooncake.config import MiB
from mooncake.config_toml import dump_toml
from mooncake.kv.integrity import checksums
from mooncake.local.machine_cluster import LocalCluster
from mooncake.security import Curve, generate_keys
from mooncake.testing.api import complete, metric, metrics
from mooncake.testing.cluster import small_config
from mooncake.testing.ports import free_port
from mooncake.testing.wait import wait_for
from mooncake.tiers.client import StoreClient, StoreError, StoreUnavailable

from oracle import greedy

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="adding an address needs root")]
MAX_MESSAGE_BYTES = 4 * MiB


@pytest.fixture(scope="module")
def address():
    addr = f"10.219.{os.getpid() % 250}.1"
    r = subprocess.run(["ip", "addr", "add", f"{addr}/32", "dev", "lo"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot add {addr} to lo: {r.stderr.strip()}")
    try:
        yield addr
    finally:
        subprocess.run(["ip", "addr", "del", f"{addr}/32", "dev", "lo"], capture_output=True)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    generate_keys(d)
    return d


@pytest.fixture(scope="module")
def cluster(address, keys, tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("data"))
    cfg.node.host = address
    cfg.security.curve_keys_dir = str(keys)
    cfg.security.max_message_bytes = MAX_MESSAGE_BYTES
    c = LocalCluster(cfg)
    c.cfg.conductor.endpoint = f"tcp://{address}:{free_port()}"  # the conductor's socket off loopback too
    try:
        c.start(timeout_s=240)
        yield c
    finally:
        c.stop()


def nodes(c: LocalCluster, role: str) -> list[dict]:
    return [n for n in httpx.get(c.url + "/cluster", timeout=10).json()["nodes"] if n["role"] == role]


def dealer(endpoint: str, curve: Curve | None, server_kind: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.client(sock, server_kind)
    sock.connect(endpoint)
    return ctx, sock


def register_as(c: LocalCluster, curve: Curve | None, role: str, node_id: str,
                facts: P.ModelFacts | None = None) -> P.Msg | None:
    """The conductor's answer to a registration (None: no answer within 3 s)."""
    ctx, sock = dealer(c.cfg.conductor.endpoint, curve, "conductor")
    try:
        endpoints = {"store": {"store": "tcp://10.9.9.9:1"}, "decode": {"kv": "tcp://10.9.9.9:2"}}.get(role, {})
        sock.send_multipart(P.encode(P.Register(role, node_id, P.NodeInfo("rogue", 1, facts, 64), endpoints)))
        return P.decode(sock.recv_multipart())[0] if sock.poll(3000) else None
    finally:
        sock.close(0)
        ctx.term()


def test_off_loopback_without_keys_roles_refuse_to_start(address, tmp_path):
    for role in ("store", "decode", "conductor"):
        cfg = small_config(tmp_path)
        cfg.node.host = address
        cfg.conductor.endpoint = f"tcp://{address}:{free_port()}"
        path = tmp_path / f"{role}.toml"
        path.write_text(dump_toml(cfg))
        r = subprocess.run([sys.executable, "-m", "mooncake.cli", "serve", "--role", role, "--config", str(path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (role, r.stderr[-2000:])
        assert "allow_insecure_network" in r.stderr and "mooncake keys" in r.stderr, r.stderr[-2000:]


def test_the_curve_cluster_off_loopback_serves_transformers_output(cluster, address, oracle_model, loaded_model):
    for n in nodes(cluster, "decode") + nodes(cluster, "store"):
        assert f"//{address}:" in next(iter(n["endpoints"].values())), n  # bound off loopback
    tok = loaded_model.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    for ids in (tok("Once upon a time")["input_ids"], tok("def fibonacci(n):\n    ")["input_ids"], list(chat)):
        r = complete(cluster.url, ids, max_tokens=12, ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(greedy(oracle_model, ids, 12), skip_special_tokens=True)


def test_registrations_without_a_key_of_the_roles_kind_are_refused(cluster, keys, tmp_path):
    generate_keys(tmp_path / "foreign")
    assert register_as(cluster, None, "store", "rogue-plain") is None  # no CURVE: no handshake, no answer
    assert register_as(cluster, Curve(tmp_path / "foreign", "store"), "store", "rogue-foreign") is None
    facts = P.ModelFacts("x", 16, 128, 10, (1, 2, 1, 16, 8))
    for role, key_of in (("prefill", "store"), ("decode", "store"), ("store", "prefill"), ("prefill", "conductor")):
        reply = register_as(cluster, Curve(keys, key_of), role, f"rogue-{role}-{key_of}", facts)
        assert isinstance(reply, P.Error) and reply.code == "unauthorized", (role, key_of, reply)
    # a worker key with other weights: the conductor's own model decides, not the registrant
    reply = register_as(cluster, Curve(keys, "prefill"), "prefill", "rogue-model", facts)
    assert isinstance(reply, P.Error) and reply.code == "model_mismatch", reply
    ids = [n["node_id"] for n in httpx.get(cluster.url + "/cluster", timeout=10).json()["nodes"]]
    assert not any(i.startswith("rogue") for i in ids)
    assert metric(metrics(cluster.url), "mooncake:registrations_refused_total", reason="key_kind") >= 4


async def _store_attacks(endpoint: str, keys, block: torch.Tensor) -> None:
    h = [b"\x01" * 32]
    keyless = StoreClient(endpoint, timeout_s=2)
    worker = StoreClient(endpoint, curve=Curve(keys, "prefill"))
    conductor = StoreClient(endpoint, curve=Curve(keys, "conductor"))
    try:
        with pytest.raises(StoreUnavailable):
            await keyless.exists(h)  # no key: the handshake never completes
        with pytest.raises(StoreError, match="may not send Replicate"):
            await worker.replicate(h, "tcp://10.9.9.9:1")  # only the conductor orders replication
        with pytest.raises(StoreError, match="may not send Put"):
            await conductor.put(h, block[None], checksums=checksums(block[None]))
        bad = checksums(block[None])
        bad[0] ^= 1
        with pytest.raises(StoreError, match="checksum"):
            await worker.put(h, block[None], checksums=bad)  # corrupt on the way: refused, not stored
        assert await worker.exists(h) == [False]
        assert await worker.put(h, block[None], checksums=checksums(block[None])) == 1
        assert await conductor.remove(h) == 1
    finally:
        for client in (keyless, worker, conductor):
            client.close()


def test_the_store_refuses_the_keyless_and_the_wrong_kinds(cluster, keys):
    endpoint = nodes(cluster, "store")[0]["endpoints"]["store"]
    asyncio.run(_store_attacks(endpoint, keys, torch.randn(2, 2, 1, 16, 8)))


def test_forged_kv_to_decode_is_dropped(cluster, keys):
    endpoint = nodes(cluster, "decode")[0]["endpoints"]["kv"]
    ctx = zmq.Context()
    try:
        for kind in ("store", "prefill"):  # a store key: not a worker; a worker key: no reserved request, no token
            curve = Curve(keys, kind)
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            curve.client(sock, "worker")
            sock.connect(endpoint)
            sock.send_multipart(P.encode(P.KVTransfer("req-forged", 0, token=b"t" * 16)))
            sock.close()
    finally:
        ctx.term()
    wait_for(lambda: metric(metrics(cluster.url), "mooncake:kv_blocks_rejected_total", reason="unauthorized") >= 1, 30,
             "the decode to count the KV from a store key")
    assert complete(cluster.url, "Still serving", max_tokens=4).status_code == 200


def test_oversized_frames_disconnect_their_sender(cluster, keys):
    """Frames over ``max_message_bytes``: the sender is disconnected before anything is decoded
    (the same messages, small, are answered: an Error from the store, a refusal from the conductor)."""
    big = MAX_MESSAGE_BYTES + 1
    store = nodes(cluster, "store")[0]["endpoints"]["store"]
    ctx, sock = dealer(store, Curve(keys, "prefill"), "store")
    try:
        for size, answered in ((1024, True), (big, False)):
            sock.send_multipart([b"rid", *P.encode(P.StatsQuery()), b"\0" * size])  # a frame it did not declare
            assert (sock.poll(3000) != 0) == answered, size
            if answered:
                assert isinstance(P.decode(sock.recv_multipart()[1:])[0], P.Error)
    finally:
        sock.close(0)
        ctx.term()
    reply = register_as(cluster, Curve(keys, "store"), "prefill", "rogue-" + "x" * big)
    assert reply is None  # disconnected: a small one gets "unauthorized" (test above)
    assert complete(cluster.url, "Still serving after that", max_tokens=4).status_code == 200
