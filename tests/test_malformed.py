"""Malformed and hostile messages to every role's socket — the conductor's ROUTER, the
decode instance's KV port, the store's ROUTER — each followed by a request that must
succeed: no single message can wedge a role. Frames are the known bad cases plus
hypothesis-generated ones (random bytes, and MessagePack maps shaped like every message
type with random fields and tensor frames).
Shapes: the pair only: it reaches every kind of socket, the decode's KV port among them."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake import protocol as P
from mooncake.testing.api import complete
from mooncake.testing.cluster import running_cluster

pytestmark = pytest.mark.timeout(300)

TAGS = [cls.__struct_config__.tag for cls in P.Message.__args__]  # type: ignore[attr-defined]
BLOCK = [30, 2, 3, 16, 64]  # SmolLM2's KV block


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("malformed"), request_timeout_s=60.0) as c:
        yield c


def endpoint(c, role: str, name: str) -> str:
    node = next(n for n in httpx.get(c.url + "/cluster", timeout=10).json()["nodes"] if n["role"] == role)
    assert node["endpoints"][name], node  # operators debug with these: /cluster keeps listing them
    return node["endpoints"][name]


def serves(c) -> None:
    r = complete(c.url, "The capital of France is", max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def nested(depth: int) -> bytes:
    """A MessagePack map nested ``depth`` deep inside an ``ok`` message's data."""
    return b"\x82\xa1t\xa2ok\xa4data" + b"\x81\xa1a" * depth + b"\xc0"


def spec_frames(tag: str, specs: list, payload: list[bytes], **fields: object) -> list[bytes]:
    return [msgspec.msgpack.encode({"t": tag, **fields, "tensors": specs}), *payload]


KNOWN_BAD = [
    [b""], [b"garbage"], [b"\xc1\xc1\xc1"], [msgspec.msgpack.encode({"t": "nope"})],
    [msgspec.msgpack.encode({"t": "heartbeat"})],  # a field missing
    [nested(100_000)],  # deeper than any decoder recursion limit
    spec_frames("kv", [["float32", [-1, 4]]], [b""], req_id="r#1", first_block=0),  # negative dimension
    spec_frames("kv", [["float32", [2, 3]]], [b"\0" * 24], req_id="r#1", first_block=0),  # not a KV block
    spec_frames("kv", [["complex128", BLOCK]], [b"\0" * 8], req_id="r#1", first_block=0),  # dtype not allowed
    spec_frames("kv", [["float32", [1] * 40]], [b"\0" * 4], req_id="r#1", first_block=0),  # too many dims
    spec_frames("kv", [], [b"surplus frame"], req_id="r#1", first_block=0),
    spec_frames("put", [["float32", [2 ** 40, 2 ** 40]]], [b""], hashes=[b"h" * 32]),  # overflowing size
    [*P.encode(P.KVTransfer("r#1", 10 ** 9)), ],  # final-looking transfer with no tensors, unknown request
    P.encode(P.TokenEvent("req-unknown#1", 0, [1, 2], P.FinishReason.STOP)),
    P.encode(P.TokenStep([P.TokenEvent("req-unknown#1", 0, [1]), P.TokenEvent("req-unknown#2", 3, [])])),
    spec_frames("token_step", [], [], events=[{"req_id": "r#1"}]),  # an event missing its fields
    P.encode(P.PrefillDone("req-unknown#1", "node0-prefill", 5, 0, 1, 0.1)),
    P.encode(P.Reserved("req-unknown#1", "node0-decode")),
    P.encode(P.Failed("req-unknown#1", "node0-decode", "nothing", P.FailureKind.FATAL)),
    P.encode(P.BlockEvent("node0-store", "stored", "dram", [b"x" * 32])),  # not from that node's socket
]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
specs = st.lists(st.tuples(st.sampled_from(["float32", "bfloat16", "int64", "uint8", "bogus"]),
                           st.lists(st.integers(-3, 70), max_size=6)), max_size=3)


@st.composite
def frames(draw, tags: list[str]) -> list[bytes]:
    """Random bytes, or a message-shaped map with random fields and tensor specs and frames."""
    if draw(st.booleans()):
        return [draw(st.binary(max_size=200)) for _ in range(draw(st.integers(1, 3)))]
    body = draw(st.dictionaries(st.sampled_from(["req_id", "node_id", "hashes", "tokens", "first_block", "index",
                                                 "kind", "role", "info", "load", "endpoints", "message", "target"]),
                                values, max_size=6))
    body["t"] = draw(st.sampled_from(tags))
    tensor_specs = draw(specs)
    if draw(st.booleans()):
        body["tensors"] = [[d, s] for d, s in tensor_specs]
    payload = [draw(st.binary(max_size=64)) for _ in range(draw(st.integers(0, 3)))]
    return [msgspec.msgpack.encode(body), *payload]


def fuzz(sock: zmq.Socket, tags: list[str], prefix: list[bytes] = (), replies: bool = False) -> None:
    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(f=frames(tags))
    def send(f: list[bytes]) -> None:
        sock.send_multipart([*prefix, *f])
        if replies:  # the store answers what it can parse as a request; drain, never block
            while sock.poll(20):
                sock.recv_multipart()

    send()


def socket(kind: int, ep: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(ep)
    return ctx, sock


def test_the_conductor_survives_any_single_message(cluster):
    ctx, sock = socket(zmq.DEALER, cluster.cfg.conductor.endpoint)
    try:
        for f in KNOWN_BAD:
            sock.send_multipart(f)
        # Registrations that could never be served are refused, and the intruder gets no work.
        info = P.NodeInfo("evil", 1)
        for reg in (P.Register("bogus", "evil-1", info), P.Register("decode", "evil-2", info),
                    P.Register("store", "evil-3", info)):
            sock.send_multipart(P.encode(reg))
            reply, _ = P.decode(sock.recv_multipart())
            assert isinstance(reply, P.Error), reply
        sock.send_multipart(P.encode(P.Heartbeat("evil-4")))
        reply, _ = P.decode(sock.recv_multipart())
        assert isinstance(reply, P.Reregister)
        fuzz(sock, [t for t in TAGS if t != "register"])  # registration is the security issue's business
    finally:
        sock.close(0)
        ctx.term()
    ids = {n["node_id"] for n in httpx.get(cluster.url + "/cluster").json()["nodes"]}
    assert not ids & {"evil-1", "evil-2", "evil-3", "evil-4"}
    for _ in range(2):
        serves(cluster)


def test_the_decode_kv_port_survives_any_single_message(cluster):
    ctx, sock = socket(zmq.PUSH, endpoint(cluster, "decode", "kv"))
    try:
        for f in KNOWN_BAD:
            sock.send_multipart(f)
        fuzz(sock, ["kv"] * 4 + TAGS)
        time.sleep(0.5)  # PUSH returns before delivery: let the decode instance read them all
    finally:
        sock.close(0)
        ctx.term()
    serves(cluster)
    health = httpx.get(cluster.url + "/health").json()
    assert health["status"] == "ok" and health["nodes"]["decode"] == 1


def test_the_store_survives_any_single_message(cluster):
    ctx, sock = socket(zmq.DEALER, endpoint(cluster, "store", "store"))
    try:
        for f in KNOWN_BAD:  # the store answers every request it can frame with an Error
            sock.send_multipart([b"rid", *f])
            reply, _ = P.decode(sock.recv_multipart()[1:])
            assert isinstance(reply, P.Error), reply
        fuzz(sock, TAGS, prefix=[b"rid"], replies=True)
    finally:
        sock.close(0)
        ctx.term()
    serves(cluster)
