"""Layer-wise loading of a cached prefix from a store (issue 12): a real store process streams the
prefix layer by layer (``GetLayers``) into a real engine while it computes the new tokens.
Streamed and whole-block loads give the same KV bit for bit and the same token; a corrupt slice or
a store that dies mid-stream fail the load before anything derived from it leaves, and a
recompute then gives the cold output."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch

from mooncake import protocol as P
from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.kv.integrity import checksums
from mooncake.protocol import Sampling
from mooncake.kv.prefix_stream import LayerGate, PrefixLoadFailed, PrefixStream
from mooncake.testing.store_process import store_process
from mooncake.tiers.client import StoreClient
from mooncake.tiers.store_requests import STREAM_FAULT_ENV

GREEDY = Sampling(max_tokens=4, temperature=0, ignore_eos=True)
TEXT = "A prefix read from the store layer by layer, just ahead of the layer that needs it. " * 12
BLOCK = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2 block, float32
MiB = 1 << 20
PREFIX = 96  # tokens: 6 blocks in the store


@contextmanager
def store(tmp_path, monkeypatch, fault: str = ""):
    if fault:
        monkeypatch.setenv(STREAM_FAULT_ENV, fault)
    with store_process(tmp_path, "--dram-bytes", str(64 * MiB), "--lmdb-bytes", "0") as endpoint:
        monkeypatch.delenv(STREAM_FAULT_ENV, raising=False)
        yield endpoint


@pytest.fixture(scope="module")
def eng(loaded_model) -> Engine:
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=32 * BLOCK, prefill_chunk_tokens=512, threads=1))


@pytest.fixture(scope="module")
def ids(loaded_model) -> list[int]:
    return loaded_model.tokenizer(TEXT)["input_ids"][:130]  # the 96-token prefix, then 34 new tokens


@pytest.fixture(scope="module")
def cold(eng, ids):
    """The cold prefill of ``ids``: (first token, prefix blocks, their hashes); the engine's cache is
    emptied again, so that every test loads the prefix from the store."""
    hashes = eng.hashes(ids)
    seq = eng.add_sequence("cold", ids, GREEDY, hashes=hashes)
    while not (step := eng.prefill(seq)).done:
        pass
    prefix = eng.kv.export_sequence(seq, 0, PREFIX // eng.block_tokens).clone()
    eng.free(seq)
    eng.blocks.forget(hashes)
    return step.token, prefix, hashes


async def put_prefix(endpoint: str, eng: Engine, cold) -> StoreClient:
    _, prefix, hashes = cold
    client = StoreClient(endpoint, timeout_s=3.0)
    n = PREFIX // eng.block_tokens
    assert await client.put(hashes[:n], prefix, eng.model_id, checksums(prefix)) == n
    return client


async def load_blockwise(eng: Engine, client: StoreClient, ids, hashes) -> tuple[int, torch.Tensor]:
    found, blocks = await client.get(hashes[:PREFIX // eng.block_tokens])
    assert eng.kv.import_blocks(found, torch.stack(blocks)) == len(found)
    seq = eng.add_sequence("block", ids, GREEDY, hashes=hashes)
    assert seq.num_cached_tokens == PREFIX
    step = eng.prefill(seq)
    kv = eng.kv.export_sequence(seq).clone()
    eng.free(seq)
    eng.blocks.forget(hashes)
    return step.token, kv


async def load_layerwise(eng: Engine, client: StoreClient, endpoint: str, ids, hashes):
    """As the prefill worker does: open the stream, start the forward at once, each layer waiting
    for its past. (token or the load's error, KV, layers shipped on verification, KV hook calls)."""
    T = eng.block_tokens
    asked = hashes[:PREFIX // T]
    stream = await PrefixStream.open(endpoint, client.get_layers(asked), asked, eng.block_shape, eng.dtype)
    assert stream is not None and stream.n == len(asked)
    seq = eng.add_sequence("layer", ids, GREEDY, hashes=hashes)
    seq.num_cached_tokens = seq.num_computed = PREFIX
    shipped: list[list[torch.Tensor]] = []
    hooked: list[int] = []
    stream.start(lambda lo, kv: eng.kv.land_layers(seq, 0, lo, kv), stream.n, shipped.append, eng.block_shape, eng.dtype)
    try:
        step = await asyncio.to_thread(eng.prefill, seq, stream.gate.hold(lambda li, f, kv: hooked.append(li)),
                                       stream.gate.wait)
    except PrefixLoadFailed as e:
        await stream.close()
        eng.free(seq)
        return e, None, shipped, hooked
    await stream.close()
    eng.kv.adopt_prefix(seq, 0, stream.n)
    kv = eng.kv.export_sequence(seq).clone()
    assert seq.block_hashes == hashes[:len(seq.block_hashes)] and len(seq.block_hashes) == len(ids) // T
    eng.free(seq)
    assert eng.cached_prefix(hashes) == len(ids) // T  # the loaded blocks are keyed, as computed ones
    eng.blocks.forget(hashes)
    return step.token, kv, shipped, hooked


async def test_layerwise_and_blockwise_loads_give_identical_kv(tmp_path, monkeypatch, eng, ids, cold):
    token, prefix, hashes = cold
    with store(tmp_path, monkeypatch) as endpoint:
        client = await put_prefix(endpoint, eng, cold)
        try:
            block_token, block_kv = await load_blockwise(eng, client, ids, hashes)
            layer_token, layer_kv, shipped, hooked = await load_layerwise(eng, client, endpoint, ids, hashes)
        finally:
            client.close()
    assert layer_token == block_token == token  # the cold prefill's greedy token
    assert torch.equal(layer_kv, block_kv)  # bit for bit, prefix and new tokens
    assert torch.equal(layer_kv[:len(prefix)], prefix)
    # the prefix went on (to decode) once verified: one [n, 2, Hkv, T, D] per layer, as stored
    assert len(shipped) == 1 and len(shipped[0]) == eng.block_shape[0]
    assert all(torch.equal(kv, prefix[:, li]) for li, kv in enumerate(shipped[0]))
    assert hooked == list(range(eng.block_shape[0]))  # the new KV's layers, each once, in order


@pytest.mark.parametrize("fault", ["corrupt", "die:3"])
async def test_a_failed_load_leaves_nothing_and_a_recompute_gives_the_cold_token(
        tmp_path, monkeypatch, eng, ids, cold, fault):
    token, _, hashes = cold
    with store(tmp_path, monkeypatch, fault) as endpoint:
        client = await put_prefix(endpoint, eng, cold)
        try:
            error, kv, shipped, hooked = await load_layerwise(eng, client, endpoint, ids, hashes)
        finally:
            client.close()
    assert isinstance(error, PrefixLoadFailed)
    assert ("checksum" in str(error)) == (fault == "corrupt"), error
    assert kv is None and shipped == [] and hooked == []  # nothing derived from the bad prefix left
    assert eng.cached_prefix(hashes) == 0  # nor was any of it keyed
    seq = eng.add_sequence("again", ids, GREEDY, hashes=hashes)
    while not (step := eng.prefill(seq)).done:
        pass
    eng.free(seq)
    eng.blocks.forget(hashes)
    assert step.token == token


async def test_a_stream_of_absent_blocks_is_a_miss(tmp_path, monkeypatch, eng, cold):
    _, _, hashes = cold
    with store(tmp_path, monkeypatch) as endpoint:
        client = StoreClient(endpoint, timeout_s=3.0)
        try:
            replies = client.get_layers(hashes[:3])
            assert await PrefixStream.open(endpoint, replies, hashes[:3], eng.block_shape, eng.dtype) is None
            # several layers per reply: one frame [n, layers, 2, Hkv, T, D] each, lowest first
            (await put_prefix(endpoint, eng, cold)).close()
            got = [(r.lo, r.hi, tuple(kv.shape), r.last) async for r, kv in client.get_layers(hashes[:2], 8)]
        finally:
            client.close()
    rest = eng.block_shape[1:]
    assert got == [(0, 8, (2, 8, *rest), False), (8, 16, (2, 8, *rest), False), (16, 24, (2, 8, *rest), False),
                   (24, 30, (2, 6, *rest), True)]


def test_layer_gate():
    gate = LayerGate()
    calls: list[int] = []
    hook = gate.hold(lambda li, first, kv: calls.append(li))
    gate.open(2)
    gate.wait(1)
    hook(0, 0, torch.zeros(1))
    hook(1, 0, torch.zeros(1))
    assert calls == []  # held until the whole prefix is verified
    gate.open(30, complete=True)
    hook(2, 0, torch.zeros(1))
    assert calls == [0, 1, 2]
    gate.fail(RuntimeError("late"))  # a failure after completion changes nothing
    gate.wait(29)
    failing = LayerGate()
    failing.open(1)
    failing.fail(ConnectionError("store gone"))
    with pytest.raises(PrefixLoadFailed, match="store gone"):
        failing.wait(5)


async def test_a_stream_closed_while_a_layer_lands_returns_only_once_it_has_landed():
    """A layer lands in a worker thread; closing the stream (an aborted request, whose blocks are
    then freed and reused) must not return while that thread may still write the pool."""
    import threading

    shape = (2, 2, 1, 4, 8)
    entered, release, order = threading.Event(), threading.Event(), []

    async def replies():
        for lo in range(2):
            yield P.LayerSlices([b"h"], lo, lo + 1, checksums=[0], last=lo == 1), torch.zeros(1, 1, *shape[1:])
            await asyncio.sleep(3600)  # the second layer never comes

    def land(lo: int, kv: torch.Tensor) -> None:  # a slow copy into the pool
        entered.set()
        release.wait(10)
        order.append("landed")

    stream = await PrefixStream.open("tcp://store", replies(), [b"h"], shape, torch.float32)
    assert stream is not None
    stream.start(land, 1, lambda layers: None, shape, torch.float32)
    await asyncio.to_thread(entered.wait, 10)
    closing = asyncio.create_task(stream.close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # still landing
    release.set()
    await closing
    order.append("closed")
    assert order == ["landed", "closed"]
