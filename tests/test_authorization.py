"""Authorization and KV trust without a cluster: the conductor's membership by key kind and
model, a decode's KV ingress by request token and checksum, the store's access table, and
the refusal to run off loopback without keys, a store's checksums on get, and the bound on
write-backs in flight."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mooncake import protocol as P
from mooncake.conductor.expected_model import ExpectedModel, expected_model
from mooncake.conductor.adoption import Adoption
from mooncake.conductor.membership import Membership
from mooncake.config import Config, MiB
from mooncake.kv.integrity import checksums
from mooncake.metrics import Metrics
from mooncake.sched.node_registry import Cluster
from mooncake.sched.kv_index import KVIndex
from mooncake.security import InsecureNetworkError, check_network, store_access_problem
from mooncake.tiers.client import StoreUnavailable

SHAPE = (2, 2, 1, 16, 8)
FACTS = P.ModelFacts("m@0123456789abcdef/float32", 16, 128, 1000, SHAPE)
EXPECTED = ExpectedModel("m@0123456789abcdef", None, 16, SHAPE)


def membership(keys_required: bool = True) -> Membership:
    return Membership(Config().liveness, Cluster(), KVIndex(), Metrics(), lambda n, why: None, {},
                      Adoption(0.0), EXPECTED, keys_required)


def register(m: Membership, node_id: str, role: str, peer: str, facts: P.ModelFacts | None = FACTS) -> P.Msg:
    endpoints = {"decode": {"kv": "tcp://10.0.0.2:1"}, "store": {"store": "tcp://10.0.0.3:1"}}.get(role, {})
    info = P.NodeInfo("n", 1, facts if role != "store" else None, 64)
    return m.register(node_id.encode(), P.Register(role, node_id, info, endpoints), 0.0, peer)


def code(reply: P.Msg) -> str:
    return reply.code if isinstance(reply, P.Error) else "registered"


def test_roles_register_only_with_keys_of_their_kind():
    m = membership()
    assert code(register(m, "p0", "prefill", "worker:K1")) == "registered"
    assert code(register(m, "s0", "store", "store:K2")) == "registered"
    assert code(register(m, "p1", "prefill", "store:K2")) == "unauthorized"  # a store key cannot be a prefill
    assert code(register(m, "s1", "store", "worker:K1")) == "unauthorized"
    assert code(register(m, "d1", "decode", "conductor:K3")) == "unauthorized"
    assert code(register(m, "d2", "decode", "")) == "unauthorized"  # no key at all
    assert {n for n in m.cluster.nodes} == {"p0", "s0"}
    assert code(register(membership(keys_required=False), "x", "prefill", "")) == "registered"  # no CURVE: as before


def test_a_node_id_cannot_be_taken_over_by_another_key():
    m = membership()
    assert code(register(m, "d0", "decode", "worker:K1")) == "registered"
    assert code(register(m, "d0", "decode", "worker:OTHER")) == "unauthorized"
    assert code(register(m, "d0", "decode", "worker:K1")) == "registered"  # the same key may re-register


def test_the_conductors_model_rules_not_the_first_registrant():
    m = membership()
    other_weights = P.ModelFacts("m@ffffffffffffffff/float32", 16, 128, 1000, SHAPE)
    other_blocks = P.ModelFacts(FACTS.model_id, 16, 128, 1000, (3, 2, 1, 16, 8))
    assert code(register(m, "p0", "prefill", "worker:K", other_weights)) == "model_mismatch"
    assert code(register(m, "p1", "prefill", "worker:K", other_blocks)) == "model_mismatch"
    assert m.facts is None  # neither fixed what the cluster serves
    assert code(register(m, "p2", "prefill", "worker:K")) == "registered" and m.facts == FACTS
    bf16 = P.ModelFacts("m@0123456789abcdef/bfloat16", 16, 128, 1000, SHAPE)
    assert code(register(m, "p3", "prefill", "worker:K", bf16)) == "model_mismatch"  # the first fixed the dtype


def test_the_expected_model_is_what_the_engine_reports(loaded_model):
    from mooncake.engine import Engine

    cfg = Config()
    cfg.model.device, cfg.engine.kv_cache_bytes = "cpu", 8 * MiB
    cfg.model.dtype = "float32"  # loaded_model's (a GGUF converted to another dtype is other weights)
    engine = Engine(loaded_model, cfg.engine)
    facts = P.ModelFacts(engine.model_id, engine.block_tokens, engine.max_model_len, engine.vocab_size,
                         tuple(engine.block_shape))
    assert expected_model(cfg).problem(facts) is None


@pytest.mark.parametrize("kind, msg, ok", [
    ("worker", P.Put([b"h"], []), True), ("store", P.Put([b"h"], []), True), ("conductor", P.Put([b"h"], []), False),
    ("worker", P.Replicate([b"h"], "tcp://10.9.9.9:1"), False), ("store", P.Replicate([b"h"], "x"), False),
    ("conductor", P.Replicate([b"h"], "x"), True), ("worker", P.Get([b"h"]), True), ("conductor", P.Get([b"h"]), False),
    ("worker", P.Remove([b"h"]), False), ("conductor", P.Remove([b"h"]), True), ("", P.Exists([b"h"]), False),
])
def test_store_access_by_key_kind(kind, msg, ok):
    class Frame:
        def get(self, name):
            assert name == "User-Id"
            return f"{kind}:KEY" if kind else ""

    assert (store_access_problem(object(), Frame(), msg) is None) == ok  # type: ignore[arg-type]
    assert store_access_problem(None, Frame(), msg) is None  # no CURVE: loopback or explicitly allowed


def test_off_loopback_needs_keys_or_an_explicit_allowance():
    for endpoints in (["tcp://127.0.0.1:5550", "127.0.0.1"], ["ipc:///tmp/c", "localhost"], ["tcp://[::1]:1", "::1"]):
        check_network("decode", endpoints, "", False)
    for endpoints in (["tcp://10.0.0.1:5550"], ["ipc:///tmp/c", "10.1.2.3"], ["tcp://*:5550"], ["0.0.0.0"],
                      ["node1.example"]):
        with pytest.raises(InsecureNetworkError, match="allow_insecure_network") as e:
            check_network("store", endpoints, "", False)
        assert "mooncake keys" in str(e.value)
        check_network("store", endpoints, "/keys", False)
        check_network("store", endpoints, "", True)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[P.Msg] = []

    async def __call__(self, msg: P.Msg) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def decode_worker():
    from mooncake.roles.decode import DecodeWorker

    cfg = Config()
    cfg.model.device, cfg.engine.kv_cache_bytes, cfg.engine.threads = "cpu", 16 * MiB, 1
    w = DecodeWorker(cfg)
    yield w
    w.host.pool.shutdown(wait=False)
    w.host.ctx.term()


async def test_decode_admits_only_kv_with_the_attempts_token_and_checksums(decode_worker):
    w = decode_worker
    w.host.send = Recorder()
    T = w.host.engine.block_tokens
    tokens = list(range(100, 100 + 2 * T))
    token = b"k" * 16
    await w.handle(P.DecodeRequest("r1", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    assert [type(m) for m in w.host.send.sent] == [P.Reserved]
    slot = w.batch.incoming["r1"]
    kv = torch.randn(2, *w.host.engine.block_shape, dtype=w.host.engine.dtype)

    def frames(tok: bytes, sums: list[int], blocks: torch.Tensor = kv) -> list:
        return P.encode(P.KVTransfer("r1", 0, token=tok, checksums=sums), list(blocks.unbind(0)))

    await w.kv.on_kv(frames(b"x" * 16, checksums(kv)))  # forged: another token
    await w.kv.on_kv(frames(b"", checksums(kv)))
    assert slot.next_block == 0 and w.host.rejections.snapshot()["token"] == 4 and "r1" in w.batch.incoming
    await w.kv.on_kv(frames(token, checksums(kv)))  # the real one still lands
    assert slot.next_block == 2

    await w.handle(P.DecodeRequest("r2", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    bad = checksums(kv)
    bad[1] ^= 1
    await w.kv.on_kv(P.encode(P.KVTransfer("r2", 0, token=token, checksums=bad), list(kv.unbind(0))))
    failed = [m for m in w.host.send.sent if isinstance(m, P.Failed)]
    assert [f.req_id for f in failed] == ["r2"] and failed[0].kind is P.FailureKind.RETRY  # recomputed elsewhere
    assert "r2" not in w.batch.incoming and w.host.rejections.snapshot()["checksum"] == 2
    await w.batch.drop("r1")


@pytest.mark.parametrize("shm", [False, True])
async def test_a_store_block_that_changed_since_its_put_is_a_miss(tmp_path, shm):
    from mooncake.config import StoreConfig
    from mooncake.tiers.client import StoreClient
    from mooncake.tiers.server import StoreServer
    from mooncake.tiers.tiered import TieredStore

    store = TieredStore.from_config(StoreConfig(dram_bytes=16 * MiB, lmdb_bytes=0, data_dir=str(tmp_path)), "s")
    server = StoreServer(store, "tcp://127.0.0.1:0")
    corrupt: list[int] = []
    client = StoreClient(await server.start(), shm=shm, shm_min_bytes=0, on_corrupt=corrupt.append)
    try:
        hs = [bytes([i]) * 32 for i in range(3)]
        kv = torch.randn(3, *SHAPE)
        assert await client.put(hs, kv, "m", checksums=checksums(kv)) == 3
        found, blocks = await client.get(hs)
        assert found == hs and torch.equal(torch.stack(blocks), kv)
        store.get_many([hs[1]], count=False)[0][1].tensor.view(-1)[0] += 1  # bit rot in the store's memory
        found, blocks = await client.get(hs)
        assert found == hs[:1] and torch.equal(blocks[0], kv[0])  # the changed block and what follows: a miss
        assert corrupt == [2]  # counted (a worker adds it to its kv_rejected{reason="checksum"})
    finally:
        client.close()
        await server.close()
        store.close()


async def test_write_backs_in_flight_are_bounded(decode_worker):
    w = decode_worker
    w.host.cfg.security.max_pending_writes = 2
    kv = torch.zeros(1, *w.host.engine.block_shape, dtype=w.host.engine.dtype)
    endpoint = "tcp://127.0.0.1:9"  # nothing answers: each put stays in flight until its timeout
    try:
        for i in range(5):
            w.host.stores.write_back(endpoint, [bytes([i]) * 32], kv)
        assert len(w.host.stores.writes) == 2 and w.host.stores.writes_dropped == 3
        assert w.load().writes_dropped == 3  # reported to the conductor (mooncake:kv_writes_dropped)
    finally:
        for task in list(w.host.stores.writes):
            task.cancel()
        await asyncio.gather(*w.host.stores.writes, return_exceptions=True)
        w.host.stores.forget(endpoint, StoreUnavailable("test over"))


def test_mooncake_keys_writes_a_keypair_per_role_kind(tmp_path, capsys):
    from mooncake.cli import main
    from mooncake.security import Curve

    assert main(["keys", str(tmp_path / "k")]) == 0
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == sorted(f"{k}.{e}" for k in ("conductor", "worker", "store", "frontend") for e in ("key", "key_secret"))
    assert all((tmp_path / "k" / n).stat().st_mode & 0o077 == 0 for n in names if n.endswith("_secret"))
    assert "key_secret" in capsys.readouterr().out
    kinds = {role: Curve(tmp_path / "k", role) for role in ("conductor", "prefill", "decode", "store", "frontend")}
    assert kinds["prefill"].public == kinds["decode"].public != kinds["store"].public != kinds["conductor"].public
    assert kinds["frontend"].kind == "frontend" and kinds["frontend"].public not in (kinds["conductor"].public,
                                                                                     kinds["prefill"].public)
    # a key per frontend, added beside the others: a frontend named "edge" loads its own
    assert main(["keys", str(tmp_path / "k"), "--frontends-only", "--frontend", "edge"]) == 0
    assert Curve(tmp_path / "k", "conductor").public == kinds["conductor"].public  # the others stay
    edge = Curve(tmp_path / "k", "frontend", "edge")
    assert edge.public != kinds["frontend"].public and edge.kinds[edge.public] == "frontend"
    assert Curve(tmp_path / "k", "frontend", "other").public == kinds["frontend"].public  # no key of its own
    assert main(["keys", str(tmp_path / "k"), "--frontend", "bad/name"]) == 2
