"""Start-up profile: time a few prefill sizes and decode batch sizes on the engine itself.

As serving engines run a profile pass to size their KV pool, each prefill and decode
instance measures how fast this machine runs this model, so that the conductor's cost
models start from real numbers instead of a guess (``mooncake.sched.cost_model``).

The engine is left as it was: the profile's prompts carry a salt of their own, every block
they keyed is dropped from the prefix cache afterwards, block events are held back while it
runs, and sizes are capped so that only free blocks are used (no cached block is evicted).
The model's scratch workspaces grow to the profiled sizes, as the first real batch of that
size would grow them.

On the 2-core CPU of BENCHMARKS.md with the bundled SmolLM2-135M, the default profile takes
2.3 s for the prefill part and 1.7 s for the decode part with one torch thread (1.4 s and
1.3 s with two); ``benchmarks/bench_cost_model.py`` measures it. Engines that start together
on one machine profile one after the other (``one_profile_at_a_time``): each measures its own
speed, not its share of cores the others are busy profiling with.
"""

from __future__ import annotations

import fcntl
import os
import statistics
import tempfile
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

import torch

from mooncake.engine.engine import Engine
from mooncake.engine.sequence import Sequence
from mooncake.protocol import Sampling
from mooncake.protocol.engine_profile import EngineProfile

PREFILL_SIZES = (32, 128, 384)
CONTEXT_SAMPLE = (128, 1024)  # new tokens after cached ones: attention over cached context
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 128
LONG_DECODE_CONTEXT = 1024  # one more sample, at batch 1: what the KV a sequence holds costs a step


def _tokens(engine: Engine, n: int, seed: int) -> list[int]:
    """Deterministic, varied ids (not one token repeated, which would not be a real prompt)."""
    return [(seed * 7919 + i * 104729 + 17) % engine.vocab_size for i in range(n)]


def _blocks(engine: Engine, tokens: int) -> int:
    return -(-tokens // engine.block_tokens)


def _release(engine: Engine, seqs: list[Sequence]) -> None:
    """Free the sequences and drop every block they keyed from the prefix cache."""
    for seq in seqs:
        engine.free(seq)
    engine.blocks.forget([h for seq in seqs for h in seq.block_hashes])


def _prefill(engine: Engine, seq: Sequence) -> float:
    t0 = time.perf_counter()
    while not engine.prefill(seq).done:
        pass
    return time.perf_counter() - t0


def _add(engine: Engine, tokens: list[int], salt: str, sampling: Sampling) -> Sequence:
    seq = engine.add_sequence("profile-%d" % len(tokens), tokens, sampling, salt)
    if seq is None:
        raise RuntimeError("profile: the KV pool could not hold %d tokens" % len(tokens))
    return seq


def _time_prefill(engine: Engine, tokens: list[int], cached: int, salt: str,
                  sampling: Sampling) -> tuple[int, int, float]:
    """(computed tokens, cached tokens, seconds) of the prefill of ``tokens`` whose first
    ``cached`` (a multiple of the block size) are found in the prefix cache (imported first,
    as zeros: the values do not change the work)."""
    prefix = engine.hashes(tokens[:cached], salt)
    seqs = []
    try:
        if prefix:
            engine.kv.import_blocks(prefix, _zeros(engine, len(prefix)))
        seqs.append(_add(engine, tokens, salt, sampling))
        seconds = _prefill(engine, seqs[0])
        return len(tokens) - seqs[0].num_cached_tokens, seqs[0].num_cached_tokens, seconds
    finally:
        _release(engine, seqs)
        engine.blocks.forget(prefix)


def _zeros(engine: Engine, blocks: int) -> torch.Tensor:
    """Zero KV blocks as they arrive (encoded: landing them decodes, as served KV does)."""
    return engine.kv.codec.encode(torch.zeros((blocks, *engine.block_shape), dtype=engine.dtype, device=engine.device))


def _time_decode(engine: Engine, batch: int, context: int, steps: int, salt: str, sampling: Sampling) -> float:
    """Median seconds of a decode step over ``batch`` sequences of ``context`` tokens (their KV is
    zeros: the values do not change the work). The first step, which gathers the batch into the
    decode workspace as a new batch does once, is not timed."""
    kv = _zeros(engine, _blocks(engine, context))
    seqs: list[Sequence] = []
    try:
        for i in range(batch):
            tokens = _tokens(engine, context, 1000 + i)
            seq = engine.reserve("profile-d%d" % i, tokens, engine.hashes(tokens, salt), engine.root(salt), sampling)
            if seq is None:
                raise RuntimeError("profile: the KV pool could not hold a decode batch of %d" % batch)
            seqs.append(seq)
            engine.kv.write_kv(seq, 0, kv)
            engine.begin_decoding(seq, 1)
        engine.decode_step(seqs)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.decode_step(seqs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        _release(engine, seqs)


@contextmanager
def one_profile_at_a_time() -> Iterator[None]:
    """Hold this machine's profile lock (a file lock in the temp directory, released by the
    kernel if the process dies)."""
    fd = os.open(os.path.join(tempfile.gettempdir(), "mooncake-profile.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def profile_engine(engine: Engine, prefill_sizes: tuple[int, ...] = PREFILL_SIZES,
                   decode_batches: tuple[int, ...] = DECODE_BATCHES, decode_context: int = DECODE_CONTEXT,
                   context_sample: tuple[int, int] = CONTEXT_SAMPLE, decode_steps: int = 3,
                   long_decode_context: int = LONG_DECODE_CONTEXT, repeats: int = 1) -> EngineProfile:
    """Measure prefill times (each size from scratch, then ``context_sample``: new tokens after
    cached ones) and decode step times (median of ``decode_steps``): each batch size at
    ``decode_context`` tokens per sequence, then batch 1 at ``long_decode_context``.
    Sizes are capped by the context limit, ``max_batch`` and the free blocks (sizes that fit
    nothing are skipped); each prefill time is the least of ``repeats`` runs. Pass ``()`` to
    skip a part: a prefill instance need not grow a decode workspace, nor a decode instance
    time prefills. Like the engine, not thread-safe: call it before serving starts."""
    t_start = time.perf_counter()
    T = engine.block_tokens
    salt = "mooncake-profile-" + uuid.uuid4().hex
    sampling = Sampling(max_tokens=1 << 30, temperature=0.0, ignore_eos=True, speculative=False)  # plain steps
    free = len(engine.blocks.free)  # every measurement gives back what it took: each may use all
    limit = min(engine.max_model_len - 1, free * T)
    sizes = sorted({min(n, limit) for n in prefill_sizes if n > 0} - {0})
    longest = max(1, min(engine.max_model_len, free * T) - (decode_steps + 2))  # a decode sequence's context

    def batches_at(context: int, wanted: tuple[int, ...]) -> list[int]:
        per_seq = _blocks(engine, context + decode_steps + 2)
        return sorted({min(b, engine.max_batch, free // per_seq) for b in wanted if b > 0} - {0})

    short = min(decode_context, longest)
    runs = [(b, short) for b in batches_at(short, decode_batches)]
    long = min(long_decode_context, longest)
    if runs and long > short and batches_at(long, (1,)):
        runs.append((1, long))
    prefill: list[tuple[int, int, float]] = []
    on_event, engine.on_block_event = engine.on_block_event, None
    try:
        if sizes:
            _time_prefill(engine, _tokens(engine, sizes[0], 0), 0, salt, sampling)  # warm-up, not recorded
        for n in sizes:
            runs_n = [_time_prefill(engine, _tokens(engine, n, run), 0, salt, sampling) for run in range(max(repeats, 1))]
            prefill.append(min(runs_n, key=lambda r: r[2]))
        n, ctx = min(context_sample[0], limit), min(context_sample[1], limit - context_sample[0]) // T * T
        if sizes and n > 0 and ctx > 0:
            prefill.append(_time_prefill(engine, _tokens(engine, ctx + n, 0), ctx, salt, sampling))
        decode = [(b, b * c, _time_decode(engine, b, c, decode_steps, salt, sampling)) for b, c in runs]
    finally:
        engine.on_block_event = on_event
    return EngineProfile(prefill, decode, chunk_tokens=engine.chunk_tokens, threads=torch.get_num_threads(),
                         seconds=time.perf_counter() - t_start)
