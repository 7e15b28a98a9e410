"""KV codecs (issue 33): blocks leave an engine encoded, travel and are stored encoded, and are
decoded where they land; round-trip error bounds, the engine's import/export in wire form,
integrity over the encoded bytes, the codec in the model id (no mixing), and a served cluster."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import msgspec
import pytest
import torch

from mooncake import protocol as P
from mooncake.blocks import root_hash
from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine
from mooncake.engine.loading.loader import model_variant
from mooncake.kv.codec import MIN_SCALE, KVCodec
from mooncake.kv.integrity import block_checksum, first_corrupt, shape_problem
from mooncake.protocol import Sampling
from mooncake.testing.api import complete, metric, metrics
from mooncake.testing.cluster import SHAPES, running_cluster, serving_role, small_config

SHAPE = (4, 2, 3, 16, 64)  # [layers, 2, kv_heads, T, head_dim]
GREEDY = Sampling(max_tokens=8, temperature=0, ignore_eos=True)
TEXT = "A paged KV cache keeps keys and values in blocks that requests share across turns. " * 20


def kv_like(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Blocks whose heads and channels differ in scale by 1000x (as K's outlier channels do)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, *SHAPE, generator=g) * torch.logspace(-2, 1, SHAPE[2]).view(1, 1, 1, -1, 1, 1)
    x *= torch.logspace(-1, 1, SHAPE[-1])[torch.randperm(SHAPE[-1], generator=g)]
    x[0, 0, 0, 0] = 0  # an all-zero head (a silent head)
    x[1, 0, 0, 0, 5:] = 0  # a partial block's tail
    return x.to(dtype)


@pytest.mark.parametrize("name,bound", [("int8", 1 / 254 * 1.001), ("fp8", 1 / 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_round_trip_errs_by_at_most_half_a_step_of_each_channels_scale(name, bound, dtype):
    codec = KVCodec(name, SHAPE, dtype)
    x = kv_like(5, dtype)
    before = x.clone()
    enc = codec.encode(x)
    assert torch.equal(x, before)  # the pool is never touched
    assert enc.dtype == torch.uint8 and tuple(enc.shape) == (5, *codec.wire_shape)
    assert codec.wire_shape == (4, 2, 3, 16 * 64 + 2 * 64)  # the codes, then a float16 scale per channel
    back = codec.decode(enc)
    assert back.dtype == dtype and back.shape == x.shape
    err = (back.float() - x.float()).abs()
    amax = x.float().abs().amax(dim=-2, keepdim=True)  # per channel, over the block's positions
    slack = 0.0 if dtype == torch.float32 else 1 / 128  # the pool's own rounding of the decoded value
    assert bool((err <= amax * (bound + slack) + MIN_SCALE).all())
    assert not back[0, 0, 0, 0].any() and not back[1, 0, 0, 0, 5:].any()
    assert torch.equal(codec.encode(back), enc) or name == "fp8" or dtype != torch.float32  # stable re-encoding
    # one layer of several blocks, and several layers, encode as the same rows
    assert torch.equal(codec.encode(x[:, 2]), enc[:, 2])
    assert torch.equal(codec.encode(x[:, 1:3]), enc[:, 1:3])


def test_none_is_the_pools_own_bytes_and_int8_halves_bfloat16():
    none = KVCodec("none", SHAPE, torch.bfloat16)
    x = kv_like(2, torch.bfloat16)
    assert none.encode(x) is x and none.wire_shape == SHAPE and none.wire_dtype == torch.bfloat16
    int8 = KVCodec("int8", SHAPE, torch.bfloat16)
    assert int8.wire_block_bytes / none.wire_block_bytes == 1152 / 2048  # codes + scales: 0.56x
    assert int8.wire_block_bytes / KVCodec("none", SHAPE, torch.float32).wire_block_bytes < 0.29
    with pytest.raises(ValueError, match="unknown kv_codec"):
        KVCodec("int4", SHAPE, torch.float32)
    with pytest.raises(ValueError, match="int8-encoded"):
        int8.decode(torch.zeros(1, *SHAPE))


def test_the_checksum_covers_the_scales_as_well_as_the_codes():
    codec = KVCodec("int8", SHAPE, torch.float32)
    enc = codec.encode(kv_like(3))
    sums = [block_checksum(b) for b in enc]
    assert first_corrupt(list(enc), sums) is None
    bad = enc.clone()
    bad[1, 3, 1, 2, -1] ^= 0x40  # a scale byte: every value of that row would decode wrong
    assert first_corrupt(list(bad), sums) == 1


def test_the_codec_is_part_of_the_model_id_and_the_hash_scheme_stays_last():
    assert model_variant(ModelConfig()) == ""
    assert model_variant(ModelConfig(kv_codec="int8")) == "+kv_int8"
    assert model_variant(ModelConfig(kv_codec="fp8", quantization="int8", block_hash="xxh3_128")) == "-int8+kv_fp8+xxh3_128"
    assert len(root_hash("m@x/bfloat16+kv_int8+xxh3_128")) == 16  # still an xxh3 chain
    assert root_hash("m@x/float32+kv_int8") != root_hash("m@x/float32")  # no block is shared across codecs


@pytest.fixture(scope="module")
def engines(loaded_model):
    def make(codec: str) -> Engine:
        loaded = dataclasses.replace(loaded_model, kv_codec=codec, model_id=loaded_model.model_id + model_variant(
            ModelConfig(kv_codec=codec)))
        return Engine(loaded, EngineConfig(kv_cache_bytes=48 << 20))
    return {c: make(c) for c in ("none", "int8")}


def run(eng: Engine, seq, n: int) -> list[int]:
    while not seq.prefilled:
        eng.prefill(seq)
    for _ in range(n - 1):
        eng.decode_step([seq])
    return seq.tokens[-n:]


def test_an_engine_exports_encoded_blocks_and_a_cached_prefix_imported_encoded_decodes_close(engines, loaded_model):
    none, int8 = engines["none"], engines["int8"]
    ids = loaded_model.tokenizer(TEXT)["input_ids"][:200]
    ref = none.add_sequence("ref", ids, GREEDY)
    want = run(none, ref, 8)
    exact = none.kv.export_sequence(ref, 0, 12)
    none.free(ref)

    a = int8.add_sequence("a", ids, GREEDY)
    assert run(int8, a, 8) == want  # computed in the pool: exact
    enc = int8.kv.export_sequence(a, 0, 12)
    assert enc.dtype == torch.uint8 and tuple(enc.shape[1:]) == int8.kv.wire_shape
    assert enc.nbytes < 0.29 * exact.nbytes  # float32 pool: a quarter of its bytes, plus the scales
    hashes = int8.hashes(ids)
    assert torch.equal(int8.kv.export_blocks(hashes), enc)
    int8.free(a)
    int8.blocks.forget(hashes)

    with pytest.raises(ValueError, match="expected"):  # a block of the pool's own shape is not wire form
        int8.kv.import_blocks(hashes[:12], exact)
    assert shape_problem(list(exact), int8.kv.wire_shape, int8.kv.wire_dtype) is not None
    assert int8.kv.import_blocks(hashes[:12], enc) == 12
    b = int8.add_sequence("b", ids, GREEDY)
    assert b.num_cached_tokens == 192
    landed = int8.kv.codec.decode(enc)
    rel = (landed - exact).norm() / exact.norm()
    assert rel < 0.02
    got = run(int8, b, 8)
    assert sum(x == y for x, y in zip(got, want)) >= 6  # the agreement the accuracy benchmark measures
    int8.free(b)

    # a decode instance's landing: whole blocks and one layer of blocks, both decoded into its pool
    d = int8.reserve("d", ids, hashes, int8.root(), GREEDY)
    int8.kv.write_kv(d, 0, enc[:6])
    for layer in range(int8.block_shape[0]):
        int8.kv.write_kv_layer(d, 6, layer, enc[6:12, layer].contiguous())
    back = int8.pool[torch.tensor(d.block_table[:12])]
    shared = d.num_cached_tokens // 16  # blocks the cache held already stay as they were
    torch.testing.assert_close(back[shared:], landed[shared:])
    int8.free(d)


def test_a_decode_refuses_kv_messages_in_another_codecs_form():
    codec = KVCodec("int8", SHAPE, torch.float32)
    raw = kv_like(2)
    frames = P.encode(P.KVTransfer("r#1", 0), list(raw.unbind(0)))
    with pytest.raises(P.ProtocolError, match="uint8"):
        P.decode(frames, codec.wire_shape, codec.wire_dtype)
    frames = P.encode(P.KVTransfer("r#1", 0), list(codec.encode(raw).unbind(0)))
    _, tensors = P.decode(frames, codec.wire_shape, codec.wire_dtype)
    assert torch.equal(torch.stack(tensors), codec.encode(raw))


def test_an_engine_of_another_codec_cannot_join(tmp_path):
    from mooncake.conductor.expected_model import expected_model

    cfg = small_config(tmp_path)
    cfg.model.kv_codec = "int8"
    want = expected_model(cfg)
    assert want is not None and want.variant == "+kv_int8"
    facts = P.ModelFacts(f"{want.weights_id}/float32", want.block_tokens, 2048, 49152, want.block_shape)
    assert "KV codec" in (want.problem(facts) or "")
    assert want.problem(msgspec.structs.replace(facts, model_id=f"{want.weights_id}/float32+kv_int8")) is None


@pytest.fixture(scope="module", params=list(SHAPES))
def int8_cluster(request, tmp_path_factory):
    cfg = small_config(tmp_path_factory.mktemp("data"))
    cfg.model.kv_codec = "int8"
    cfg.engine.kv_cache_bytes = 24 << 20  # 34 blocks: two other prompts push a prefix out to the store
    with running_cluster(cfg=cfg, **SHAPES[request.param]) as c:
        c.shape = request.param
        yield c


def test_a_served_int8_cluster_moves_and_stores_a_quarter_of_float32s_bytes_and_answers_alike(
        int8_cluster, loaded_model, oracle_model):
    from oracle import greedy

    url = int8_cluster.url
    ids = loaded_model.tokenizer(TEXT)["input_ids"][:16 * 12 + 5]
    want = loaded_model.tokenizer.decode(greedy(oracle_model, ids, 8)[:4])

    def ask(prompt: list[int]) -> httpx.Response:
        r = complete(url, prompt, max_tokens=8, temperature=0, ignore_eos=True)
        assert r.status_code == 200, r.text
        return r

    assert ask(ids).json()["choices"][0]["text"].startswith(want)  # the decode ran on int8 KV of the prompt
    for start in (20000, 21000):  # push the prompt out of the prefill's device cache
        ask(list(range(start, start + 320)))
    again = ask(ids)  # its prefix now comes from the store, streamed layer by layer in int8
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    assert again.json()["choices"][0]["text"].startswith(want)
    nodes = httpx.get(url + "/cluster").json()["nodes"]
    prefill = next(n for n in nodes if n["role"] == serving_role(int8_cluster.shape, "prefill"))
    block = prefill["kv_block_bytes"]
    assert block == 30 * 2 * 3 * (16 * 64 + 2 * 64) < 0.29 * 30 * 2 * 3 * 16 * 64 * 4  # float32's
    tiers = [t for n in nodes if n["role"] == "store" for t in n["load"]["tiers"].values() if t["blocks"]]
    assert tiers and all(t["used_bytes"] == t["blocks"] * block for t in tiers)
    m = metrics(url)
    assert metric(m, "mooncake:kv_bytes_moved_total", path="store_to_prefill") == 12 * block
    to_decode = (13 + 20 + 20 + 13) * block if int8_cluster.shape == "pair" else 0  # KV of all but the last token
    assert metric(m, "mooncake:kv_bytes_moved_total", path="prefill_to_decode") == to_decode


def test_extreme_channels_saturate_instead_of_turning_nan_and_long_runs_encode_in_slices():
    codec = KVCodec("int8", SHAPE, torch.float32)
    x = kv_like(70)  # more blocks than one slice of the encoder
    x[3, 1, 0, 2, :, 7] = 1e7  # past 127 x float16's largest scale
    enc = codec.encode(x)
    assert torch.equal(enc, torch.cat([codec.encode(b.unsqueeze(0)) for b in x]))
    back = codec.decode(enc)
    assert torch.isfinite(back).all() and back[3, 1, 0, 2, 0, 7] == 127 * 65504


def test_a_partial_blocks_stale_positions_are_not_encoded(engines, loaded_model):
    eng = engines["int8"]
    ids = loaded_model.tokenizer(TEXT)["input_ids"][:40]  # 2 blocks and 8 positions
    seq = eng.add_sequence("tail", ids, GREEDY)
    eng.prefill(seq)
    last = seq.block_table[2]
    eng.pool[last, ..., 8:, :] = 1e3  # what a reused block holds past the prompt's end
    out = eng.kv.codec.decode(eng.kv.export_sequence(seq, 2, 3))
    assert not out[0, ..., 8:, :].any()  # zeros, as layer-wise KV leaves them
    assert out[0, ..., :8, :].abs().max() < 100  # the valid positions' scales are their own
    eng.free(seq)


def poisoned(enc: torch.Tensor, block: int, value: float) -> torch.Tensor:
    """``enc`` with one float16 scale of block ``block`` (layer 1, V, head 0, last channel) set to ``value``."""
    bad = enc.clone()
    bad[block, 1, 1, 0, -2:] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    return bad


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_block_with_a_non_finite_scale_is_corrupt(value):
    """Decoded, it would poison every prompt that reuses it: refused like a checksum mismatch."""
    from mooncake.kv.integrity import first_nonfinite

    codec = KVCodec("int8", SHAPE, torch.float32)
    enc = codec.encode(kv_like(3))
    assert codec.first_nonfinite(enc) is None and first_nonfinite(list(enc), codec) is None
    bad = poisoned(enc, 1, value)
    assert not codec.decode(bad[1]).isfinite().all()  # what it would bring into a pool
    assert codec.first_nonfinite(bad) == 1 and first_nonfinite(list(bad), codec) == 1
    assert codec.first_nonfinite(bad[:, 1]) == 1 and codec.first_nonfinite(bad[:, 2]) is None  # per layer
    assert KVCodec("none", SHAPE, torch.float32).first_nonfinite(kv_like(2)) is None  # no scales


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
def test_an_fp8_block_with_a_nan_code_is_corrupt():
    codec = KVCodec("fp8", SHAPE, torch.float32)
    enc = codec.encode(kv_like(2))
    bad = enc.clone()
    bad[1, 0, 0, 0, 5] = 0x7F  # float8 e4m3's NaN
    assert codec.first_nonfinite(enc) is None and codec.first_nonfinite(bad) == 1


async def test_a_stored_block_with_a_non_finite_scale_is_a_miss_and_recomputed(engines):
    """Block-wise prefix load: the poisoned block and those after it are not imported (counted as
    checksum failures); the blocks before it are."""
    from mooncake.kv.integrity import Rejections
    from mooncake.kv.prefix_load import PrefixLoader

    eng = engines["int8"]
    hashes = eng.hashes(list(range(1000, 1100)))[:4]  # a prompt no other test caches
    bad = poisoned(eng.kv.codec.encode(torch.randn(4, *eng.block_shape, dtype=eng.dtype)), 2, float("inf"))

    class Stores:
        def client(self, endpoint: str) -> Stores:
            return self

        async def get(self, asked: list, prefix: bool = True) -> tuple[list, list[torch.Tensor]]:
            return list(asked), list(bad)  # what the store holds, its checksums intact

    async def run_engine(fn, *args):
        return fn(*args)

    rejections = Rejections()
    loader = PrefixLoader(eng, run_engine, Stores(), rejections, None)  # type: ignore[arg-type]
    try:
        got, _ = await loader.fetch([P.FetchPlan(0, 4, "tcp://store")], hashes)
        assert got == 2 and eng.blocks.cached_prefix(hashes) == 2
        assert rejections.snapshot() == {"checksum": 2}
    finally:
        eng.blocks.forget(hashes)


async def test_a_streamed_layer_with_a_non_finite_scale_fails_the_load_before_it_lands(engines, loaded_model):
    """Layer-wise prefix load: the landing refuses the layer; the gate fails as on a checksum
    mismatch (counted so by the prefill) and the pool rows stay as they were."""
    from mooncake.kv.integrity import checksums
    from mooncake.kv.prefix_stream import PrefixLoadFailed, PrefixStream

    eng = engines["int8"]
    ids = loaded_model.tokenizer(TEXT)["input_ids"][:70]
    seq = eng.add_sequence("streamed", ids, GREEDY)
    hashes = seq.hashes[:4]
    bad = poisoned(eng.kv.codec.encode(torch.randn(4, *eng.block_shape, dtype=eng.dtype)), 3, float("nan"))
    layers = eng.block_shape[0]

    async def replies():
        for lo in range(layers):
            yield P.LayerSlices(list(hashes), lo, lo + 1, checksums=checksums(bad), last=lo == layers - 1), \
                bad[:, lo:lo + 1].contiguous()

    rows = torch.tensor(seq.block_table[:4])
    before = eng.pool[rows, 1].clone()
    try:
        stream = await PrefixStream.open("tcp://store", replies(), list(hashes), eng.kv.wire_shape, eng.kv.wire_dtype)
        assert stream is not None
        stream.start(lambda lo, kv: eng.kv.land_layers(seq, 0, lo, kv), 4, lambda layers: None,
                     eng.kv.wire_shape, eng.kv.wire_dtype)
        with pytest.raises(PrefixLoadFailed, match="checksum"):
            await asyncio.to_thread(stream.gate.wait, layers - 1)
        await stream.close()
        assert torch.equal(eng.pool[rows, 1], before)  # the poisoned layer never landed
    finally:
        eng.free(seq)


@pytest.fixture(scope="module")
def int8_decode_worker():
    from mooncake.config import Config
    from mooncake.roles.decode import DecodeWorker

    cfg = Config()
    cfg.model.device, cfg.model.kv_codec, cfg.engine.kv_cache_bytes, cfg.engine.threads = "cpu", "int8", 16 << 20, 1
    w = DecodeWorker(cfg)
    yield w
    w.host.pool.shutdown(wait=False)
    w.host.ctx.term()


@pytest.mark.parametrize("layer", [None, 1])
async def test_a_decode_refuses_kv_with_a_non_finite_scale_as_corrupt(int8_decode_worker, layer):
    """Whole blocks or one layer of them, checksums intact: the attempt fails and is recomputed elsewhere."""
    from mooncake.kv.integrity import checksums

    w = int8_decode_worker
    sent: list[P.Msg] = []

    async def send(msg: P.Msg) -> None:
        sent.append(msg)

    w.host.send = send
    T, token, req = w.host.engine.block_tokens, b"k" * 16, f"poisoned-{layer}"
    before = w.host.rejections.snapshot().get("checksum", 0)
    await w.handle(P.DecodeRequest(req, list(range(100, 100 + 2 * T)), [], b"root", P.Sampling(max_tokens=2),
                                   kv_token=token), [])
    assert req in w.batch.incoming
    kv = poisoned(w.host.engine.kv.codec.encode(torch.randn(2, *w.host.engine.block_shape, dtype=w.host.engine.dtype)), 1,
                  float("inf"))
    if layer is None:
        frames = P.encode(P.KVTransfer(req, 0, token=token, checksums=checksums(kv)), list(kv.unbind(0)))
    else:
        part = kv[:, layer].contiguous()
        frames = P.encode(P.KVLayer(req, 0, layer, token=token, checksums=checksums([part])), [part])
    await w.kv.on_kv(frames)
    failed = [m for m in sent if isinstance(m, P.Failed)]
    assert [f.req_id for f in failed] == [req] and failed[0].kind is P.FailureKind.RETRY
    assert req not in w.batch.incoming and w.host.rejections.snapshot()["checksum"] > before
