"""Layer-wise KV (issue 12): a prefill chunk's KV handed out layer by layer, assembled by a
receiving engine layer by layer, is the KV the block-wise path ships; greedy output is the same."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.kv.layers import completed_blocks, split_runs
from mooncake.protocol import Sampling

from decode_workers import Recorder, small_decode_worker

GREEDY = Sampling(max_tokens=8, temperature=0, ignore_eos=True)
TEXT = "Each layer's keys and values leave as soon as that layer is computed. " * 12
BLOCK = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2 block, float32


@pytest.fixture(scope="module")
def ids(loaded_model) -> list[int]:
    return loaded_model.tokenizer(TEXT)["input_ids"][:150]  # 9 full blocks and a partial one


def engine(loaded_model, **kw) -> Engine:
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=64 * BLOCK, prefill_chunk_tokens=40, threads=1, **kw))


def test_completed_blocks():
    assert completed_blocks(0, 40, False, 16) == (0, 2)
    assert completed_blocks(40, 80, False, 16) == (2, 5)  # block 2 began in the previous chunk
    assert completed_blocks(80, 90, True, 16) == (5, 6)  # the partial tail counts at the end
    assert completed_blocks(80, 96, True, 16) == (5, 6)


def test_split_runs_keeps_frames_small():
    kv = torch.arange(7.0).view(7, 1)
    parts = list(split_runs(3, kv, 3))
    assert [(f, p.flatten().tolist()) for f, p in parts] == [(3, [0, 1, 2]), (6, [3, 4, 5]), (9, [6])]
    assert all(p.is_contiguous() for _, p in parts)
    assert [f for f, _ in split_runs(0, kv, 0)] == list(range(7))  # at least one block per piece


def _prefill_layerwise(src: Engine, dst: Engine, ids: list[int], cached_prefix: bool,
                       stage_row: int | None = None) -> tuple:
    """Prefill ``ids`` on ``src`` shipping layer by layer into a sequence reserved on ``dst``
    (as decode reserves it); the reused prefix travels as whole blocks. (src seq, dst seq, first token)."""
    hashes = src.hashes(ids)
    seq = src.add_sequence("a", ids, GREEDY, hashes=hashes)
    assert (seq.num_cached_tokens > 0) == cached_prefix
    into = dst.reserve("a", ids, hashes, src.root(), GREEDY)
    assert into is not None
    T = src.block_tokens
    if seq.num_cached_tokens:
        dst.kv.write_kv(into, 0, src.kv.export_sequence(seq, 0, seq.num_cached_tokens // T), stage_row)
    got: list[tuple[int, int, int]] = []

    def on_layer(layer: int, first: int, kv: torch.Tensor) -> None:
        got.append((layer, first, len(kv)))
        dst.kv.write_kv_layer(into, first, layer, kv.clone(), stage_row)

    while True:
        step = src.prefill(seq, on_layer)
        if step.done:
            break
    layers = src.block_shape[0]
    # every layer of every new block arrives exactly once, in order per layer
    for layer in range(layers):
        spans = [(f, n) for li, f, n in got if li == layer]
        assert spans[0][0] == seq.num_cached_tokens // T
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
        assert spans[-1][0] + spans[-1][1] == len(into.block_table)
    return seq, into, step


@pytest.mark.parametrize("cached_prefix", [False, True])
def test_layerwise_kv_equals_blockwise_kv_and_output(loaded_model, ids, cached_prefix):
    src, dst = engine(loaded_model), engine(loaded_model)
    if cached_prefix:  # a first request leaves 6 blocks in src's device cache
        warm = src.add_sequence("w", ids[:100], GREEDY)
        while not src.prefill(warm).done:
            pass
        src.free(warm)
    seq, into, step = _prefill_layerwise(src, dst, ids, cached_prefix)
    n = len(ids)
    T = src.block_tokens
    blockwise = src.kv.export_sequence(seq)  # what the block-wise path ships: the pool's blocks
    landed = dst.kv.export_sequence(into, 0, len(into.block_table))
    flat = lambda kv: kv.permute(1, 2, 3, 0, 4, 5).reshape(*kv.shape[1:4], -1, kv.shape[-1])[:, :, :, :n]
    assert torch.equal(flat(landed), flat(blockwise))  # bit for bit, every valid position
    assert (flat(landed).shape[3] == n) and len(into.block_table) == -(-n // T)
    # the receiver decodes from the assembled KV as the sender decodes from its own
    dst.begin_decoding(into, step.token)
    for _ in range(7):
        a = src.decode_step([seq])[0].token
        b = dst.decode_step([into])[0].token
        assert a == b
    assert into.tokens == seq.tokens


@pytest.mark.parametrize("row", [0, 1])
def test_kv_staged_into_its_decode_row_as_it_lands_spares_the_first_step_its_gather(loaded_model, ids, row):
    """Landing KV is copied into the decode workspace row the sequence takes at its first step; the
    step then uses the row as it is (row 0: the sequence's row) or gathers as always (row 1: a wrong
    guess); the tokens are the sender's either way."""
    src, dst = engine(loaded_model), engine(loaded_model)
    for turn in range(2):  # the first turn grows the workspace as its KV lands; the second has a cached prefix
        seq, into, step = _prefill_layerwise(src, dst, ids, turn > 0, row)
        gathers = dst.model.row_gathers
        dst.begin_decoding(into, step.token)
        for _ in range(4):
            assert src.decode_step([seq])[0].token == dst.decode_step([into])[0].token
        assert dst.model.row_gathers - gathers == (0 if row == 0 else 1)
        assert into.tokens == seq.tokens
        src.free(seq)
        dst.free(into)


def test_write_kv_layer_refuses_what_does_not_fit(loaded_model, ids):
    eng = engine(loaded_model)
    seq = eng.reserve("r", ids, eng.hashes(ids), eng.root(), GREEDY)
    layer = torch.zeros(2, *eng.block_shape[1:])
    with pytest.raises(ValueError, match="does not fit"):
        eng.kv.write_kv_layer(seq, 9, 0, layer)  # blocks 9..11 of 10
    with pytest.raises(ValueError, match="does not fit"):
        eng.kv.write_kv_layer(seq, 0, eng.block_shape[0], layer)  # no such layer
    with pytest.raises(ValueError, match="expected"):
        eng.kv.write_kv_layer(seq, 0, 0, torch.zeros(2, *eng.block_shape))


@pytest.fixture(scope="module")
def decode_worker():
    yield from small_decode_worker()


async def test_decode_assembles_layers_and_uses_a_block_only_when_whole(decode_worker):
    from mooncake import protocol as P
    from mooncake.kv.integrity import checksums

    w = decode_worker
    w.host.send = Recorder()
    eng = w.host.engine
    L, T = eng.block_shape[0], eng.block_tokens
    tokens = list(range(100, 100 + 3 * T))
    token = b"k" * 16
    kv = torch.randn(3, *eng.block_shape, dtype=eng.dtype)

    def layer_msg(rid: str, first: int, n: int, layer: int, corrupt: bool = False) -> list:
        part = kv[first:first + n, min(layer, L - 1)].contiguous()
        sums = checksums([part])
        if corrupt:
            sums[0] ^= 1
        return P.encode(P.KVLayer(rid, first, layer, token=token, checksums=sums), [part])

    await w.handle(P.DecodeRequest("r1", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    slot = w.batch.incoming["r1"]
    await w.kv.on_kv(P.encode(P.KVTransfer("r1", 0, token=token, checksums=checksums(kv[:1])), [kv[0]]))
    assert slot.next_block == 1  # a whole block counts for every layer
    for layer in range(L):
        await w.kv.on_kv(layer_msg("r1", 1, 1, layer))
        assert slot.next_block == (2 if layer == L - 1 else 1)  # block 1 is used only once whole
    for layer in reversed(range(L)):  # layers may arrive in any order; blocks per layer in order
        await w.kv.on_kv(layer_msg("r1", 2, 1, layer))
    assert slot.kv_complete and not [m for m in w.host.send.sent if isinstance(m, P.Failed)]
    landed = eng.kv.export_sequence(slot.seq, 0, 3)
    assert torch.equal(landed, kv)
    await w.batch.drop("r1")

    await w.handle(P.DecodeRequest("r2", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    await w.kv.on_kv(layer_msg("r2", 1, 1, 0))  # skips block 0 of layer 0: out of order
    await w.handle(P.DecodeRequest("r3", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    await w.kv.on_kv(layer_msg("r3", 0, 2, 5, corrupt=True))
    await w.handle(P.DecodeRequest("r4", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    await w.kv.on_kv(layer_msg("r4", 0, 1, L))  # no such layer
    failed = {m.req_id: m.message for m in w.host.send.sent if isinstance(m, P.Failed)}
    assert set(failed) == {"r2", "r3", "r4"}
    assert "checksum" in failed["r3"] and "out of order" in failed["r2"] and "out of order" in failed["r4"]
    await w.handle(P.DecodeRequest("r5", tokens, [], b"root", P.Sampling(max_tokens=2), kv_token=token), [])
    empty = P.encode(P.KVLayer("r5", 0, 0, token=token, checksums=[0]), [torch.zeros(0, *eng.block_shape[1:])])
    await w.kv.on_kv(empty)  # malformed: dropped, the request still waits for its KV
    assert "r5" in w.batch.incoming and w.batch.incoming["r5"].next_block == 0
    await w.batch.drop("r5")
