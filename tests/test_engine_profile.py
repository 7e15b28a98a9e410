"""The start-up profile on the real bundled model: sane numbers, capped sizes, a clean engine."""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile

import msgspec
import pytest

from mooncake.config import EngineConfig
from mooncake.engine import Engine
from mooncake.engine.profile import one_profile_at_a_time, profile_engine
from mooncake.protocol import Sampling
from mooncake.sched.cost_model import DecodeCostModel, PrefillCostModel
from mooncake.protocol.engine_profile import EngineProfile

MiB = 1 << 20


def engine_with(loaded_model, **kw) -> Engine:
    return Engine(loaded_model, EngineConfig(kv_cache_bytes=kw.pop("kv_cache_bytes", 64 * MiB), **kw))


def warm_cache(eng: Engine, n: int = 40) -> list:
    """A real prompt prefilled and freed: its full blocks stay cached."""
    tokens = [(i * 31 + 7) % 5000 + 1 for i in range(n)]
    seq = eng.add_sequence("warm", tokens, Sampling(max_tokens=1, temperature=0.0))
    while not eng.prefill(seq).done:
        pass
    eng.free(seq)
    return eng.hashes(tokens)


def test_profile_measures_sane_numbers_and_leaves_the_engine_clean(loaded_model):
    eng = engine_with(loaded_model)
    hashes = warm_cache(eng)
    events = []
    eng.on_block_event = lambda kind, hs: events.append(kind)
    before = eng.stats()
    cached_before = eng.cached_prefix(hashes)
    assert cached_before == 2

    p = profile_engine(eng, prefill_sizes=(16, 64, 128), decode_batches=(1, 4), decode_context=32,
                       context_sample=(32, 96))

    assert eng.stats() == before
    assert eng.cached_prefix(hashes) == cached_before  # nothing of the engine's own cache evicted
    assert events == []  # the conductor's index hears nothing of the profile
    eng.blocks.check()
    assert [(n, c) for n, c, _ in p.prefill] == [(16, 0), (64, 0), (128, 0), (32, 96)]
    assert p.chunk_tokens == eng.chunk_tokens
    # each batch at 32 tokens per sequence, then batch 1 at the long context (capped by max_model_len)
    long = min(1024, eng.max_model_len - 5)
    assert [(b, kv) for b, kv, _ in p.decode] == [(1, 32), (4, 128), (1, long)]
    assert all(0 < s < 60 and math.isfinite(s) for *_, s in p.prefill + p.decode)
    assert p.prefill[2][2] > p.prefill[0][2]  # 128 tokens take longer than 16 (8x the work)
    assert p.threads >= 1 and p.seconds > 0


def test_profile_travels_on_the_wire_and_seeds_both_models(loaded_model):
    eng = engine_with(loaded_model)
    p = profile_engine(eng, prefill_sizes=(16, 128), decode_batches=(1, 4), decode_context=16,
                       context_sample=(64, 256))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=EngineProfile)
    assert back == p
    pc = PrefillCostModel.from_profile(back.prefill, chunk_tokens=back.chunk_tokens)
    dc = DecodeCostModel.from_profile(back.decode)
    for n, ctx, s in p.prefill:  # the seeded prior reproduces its own measurements roughly
        assert s / 2 <= pc.predict(n, ctx) <= 2 * s
    assert pc.predict(16, 0) <= pc.predict(1000, 0) <= pc.predict(1000, 1000)
    for b, kv, s in p.decode:
        assert s / 2 <= dc.predict(b, kv) <= 2 * s
    assert dc.predict(1, 16) <= dc.predict(1, 1000) <= dc.predict(4, 1000)


def test_profile_sizes_are_capped_by_context_batch_and_free_blocks(loaded_model):
    eng = engine_with(loaded_model, kv_cache_bytes=12 * eng_block_bytes(loaded_model), max_batch=2,
                      max_model_len=100)
    eng.blocks.allocate(2)  # held by someone: 10 free blocks of 16 tokens remain
    p = profile_engine(eng, prefill_sizes=(8, 500, 99), decode_batches=(1, 8), decode_context=40,
                       context_sample=(20, 200))
    assert [(n, c) for n, c, _ in p.prefill] == [(8, 0), (99, 0), (20, 64)]  # 64: 99 - 20, in whole blocks
    # each decode sequence needs ceil((40 + 3 + 2) / 16) = 3 blocks: 10 // 3 = 3, then max_batch = 2
    # and batch 1 at the longest context that fits: min(1024, 100 - 5) = 95 tokens in 7 blocks
    assert [(b, kv) for b, kv, _ in p.decode] == [(1, 40), (2, 80), (1, 95)]
    assert eng.stats()["free_blocks"] == 10 and eng.stats()["used_blocks"] == 2


def test_profile_of_a_full_pool_is_empty_and_seeds_the_default_prior(loaded_model):
    eng = engine_with(loaded_model, kv_cache_bytes=4 * eng_block_bytes(loaded_model))
    eng.blocks.allocate(4)
    p = profile_engine(eng)
    assert p.prefill == [] and p.decode == []
    assert PrefillCostModel.from_profile(p.prefill).weights == pytest.approx(PrefillCostModel().weights)


def eng_block_bytes(loaded_model) -> int:
    return engine_with(loaded_model, kv_cache_bytes=1 * MiB).block_bytes


def test_engines_of_one_machine_profile_one_at_a_time(tmp_path, monkeypatch):
    """While one process holds the profile lock, another one's attempt waits (here: fails
    without blocking), and the lock is free again once the holder is done."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    try_lock = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)")
    path = str(tmp_path / "mooncake-profile.lock")
    try:
        with one_profile_at_a_time():
            assert subprocess.run([sys.executable, "-c", try_lock, path]).returncode == 3
        assert subprocess.run([sys.executable, "-c", try_lock, path]).returncode == 0
    finally:
        tempfile.tempdir = None
