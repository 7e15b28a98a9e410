"""CURVE on the role links: a cluster with role keys serves; peers without them cannot join;
keys of the wrong kind cannot take a role (the conductor authorizes by key kind).
Shapes: the pair only: it has the most links (the KV link among them) to put under CURVE."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq

from mooncake import protocol as P
from mooncake.security import Curve, CurveError, generate_keys
from mooncake.testing.api import complete
from mooncake.testing.cluster import running_cluster, small_config

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys)
    cfg = small_config(tmp_path_factory.mktemp("data"))
    cfg.security.curve_keys_dir = str(keys)
    with running_cluster(cfg=cfg) as c:
        yield c


def try_register(endpoint: str, node_id: str, keys_dir=None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        Curve(keys_dir, "store").client(sock, "conductor")
    sock.connect(endpoint)
    reg = P.Register(role="store", node_id=node_id, info=P.NodeInfo("rogue", 1), endpoints={"store": "tcp://127.0.0.1:9"})
    sock.send_multipart(P.encode(reg))
    got = sock.poll(2000)
    sock.close(0)
    ctx.term()
    assert got == 0, "the conductor answered an unauthenticated peer"


def test_cluster_with_curve_serves_requests(cluster):
    r = complete(cluster.url, "Hello there", max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    nodes = httpx.get(cluster.url + "/cluster").json()["nodes"]
    assert sorted(n["role"] for n in nodes) == ["decode", "frontend", "prefill", "store"]  # tokens under CURVE too


def test_peers_without_the_cluster_key_cannot_register(cluster, tmp_path):
    endpoint = cluster.cfg.conductor.endpoint
    try_register(endpoint, "rogue-plain")
    other = tmp_path / "other"
    generate_keys(other)
    try_register(endpoint, "rogue-other-key", keys_dir=other)
    time.sleep(0.5)
    ids = [n["node_id"] for n in httpx.get(cluster.url + "/cluster").json()["nodes"]]
    assert not any(i.startswith("rogue") for i in ids)
    assert complete(cluster.url, "Still serving", max_tokens=2).status_code == 200


def test_missing_keys_are_a_clear_error(tmp_path):
    with pytest.raises(CurveError, match="mooncake keys"):
        Curve(tmp_path / "nowhere", "store")
