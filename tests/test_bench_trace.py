"""Trace reading, validation, scaling and hash-id expansion (mooncake.bench.trace)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.bench.prompts import TokenRange, block_token_ids, ids_to_text
from mooncake.bench.trace import (TraceError, TraceRecord, TraceScaling, expand_prompt, load_trace,
                                  parse_trace_line, scaled_input_length, trace_sessions)

RANGE = TokenRange(1000, 30000)


def rec(hash_ids, input_length=None, output_length=10, ts=0.0, line_no=1) -> TraceRecord:
    n = len(hash_ids)
    return TraceRecord(line_no, ts, n * 512 if input_length is None else input_length, output_length,
                       tuple(hash_ids))


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_same_hash_id_same_tokens_and_range():
    a = block_token_ids(42, 32, RANGE)
    assert a == block_token_ids(42, 32, RANGE)
    assert a != block_token_ids(43, 32, RANGE)
    assert all(RANGE.lo <= t < RANGE.hi for t in a)
    assert len(block_token_ids(7, 5, RANGE)) == 5
    assert block_token_ids(42, 32, TokenRange(0, 50)) != a  # the range is an input


def test_block_boundaries_preserved():
    r = rec([5, 9, 11])
    toks = expand_prompt(r, 16, RANGE)
    assert len(toks) == 48
    assert toks[0:16] == block_token_ids(5, 16, RANGE)
    assert toks[16:32] == block_token_ids(9, 16, RANGE)
    assert toks[32:48] == block_token_ids(11, 16, RANGE)
    # the same hash id at another position (or in another request) gives the same block
    other = expand_prompt(rec([11, 5]), 16, RANGE)
    assert other[:16] == toks[32:48] and other[16:] == toks[:16]


def test_partial_last_block_scales_proportionally():
    r = rec([1, 2, 3], input_length=2 * 512 + 128)  # last block a quarter full
    assert scaled_input_length(r, 32) == 2 * 32 + 8
    toks = expand_prompt(r, 32, RANGE)
    assert len(toks) == 72
    assert toks[64:] == block_token_ids(3, 32, RANGE)[:8]
    # a 1-token tail never vanishes, full blocks scale exactly
    assert scaled_input_length(rec([1, 2], input_length=513), 32) == 33
    assert scaled_input_length(rec([1, 2], input_length=1024), 32) == 64
    assert scaled_input_length(rec([1], input_length=300), 512) == 300


@settings(max_examples=60, deadline=None)
@given(shared=st.integers(0, 6), tail_a=st.integers(0, 4), tail_b=st.integers(0, 4),
       block=st.sampled_from([1, 4, 16, 32, 512]))
def test_scaling_keeps_sharing_structure(shared, tail_a, tail_b, block):
    prefix = list(range(100, 100 + shared))
    a_ids = prefix + list(range(1000, 1000 + tail_a))
    b_ids = prefix + list(range(2000, 2000 + tail_b))
    if not a_ids or not b_ids:
        return
    a = expand_prompt(rec(a_ids), block, RANGE)
    b = expand_prompt(rec(b_ids), block, RANGE)
    expected = shared * block
    if tail_a and tail_b:
        assert common_prefix(a, b) == expected  # exactly k blocks shared, no more
    else:
        assert common_prefix(a, b) >= expected
        assert a[:expected] == b[:expected]


def test_real_trace_sharing(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 100, "input_length": 2048, "output_length": 7, "hash_ids": [0, 1, 3, 4]},
        {"timestamp": 250, "input_length": 10, "output_length": 3, "hash_ids": [9]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    records = load_trace(path)
    assert [r.line_no for r in records] == [1, 2, 3]
    sessions = trace_sessions(records, TraceScaling(block_tokens=32, time_scale=0.5,
                                                    max_output_tokens=6), RANGE)
    p = [s.turns[0] for s in sessions]
    assert common_prefix(p[0], p[1]) == 64
    assert len(p[0]) == 64 + round((1500 - 1024) * 32 / 512) and len(p[1]) == 128
    assert len(p[2]) == 1  # 10/512 of a block rounds to 1 token, never 0
    assert [s.arrival_s for s in sessions] == [0.0, 0.05, 0.125]
    assert [s.max_tokens[0] for s in sessions] == [5, 6, 3]
    capped = trace_sessions(records, TraceScaling(block_tokens=32, max_input_tokens=40,
                                                  max_requests=2), RANGE)
    assert len(capped) == 2 and [len(s.turns[0]) for s in capped] == [40, 40]
    assert capped[0].turns[0] == p[0][:40]
    within = trace_sessions(records, TraceScaling(duration_s=0.2), RANGE)
    assert len(within) == 2


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 10', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": [1]}', "missing field 'timestamp'"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "missing field 'output_length'"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]}', "'input_length' must be >= 0"),
    ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}', "'output_length' must be >= 0"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "a"]}', "'hash_ids' must hold integers"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}', "'hash_ids' must hold integers"),
    ('{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [1]}', "'input_length' must be an integer"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', "inconsistent with 2 hash_ids"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}', "inconsistent with 2 hash_ids"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "'hash_ids' is empty"),
])
def test_invalid_lines_name_the_line(tmp_path, line, message):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line_no == 3
    assert "bad.jsonl:3: " in str(info.value)
    assert message in str(info.value)


def test_empty_trace_and_scaling_bounds(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="empty"):
        load_trace(path)
    with pytest.raises(ValueError):
        TraceScaling(block_tokens=0)
    with pytest.raises(ValueError):
        TraceScaling(time_scale=0)
    assert parse_trace_line('{"timestamp": 1.5, "input_length": 1, "output_length": 0, "hash_ids": [3]}',
                            "x", 1).timestamp_ms == 1.5


def test_text_mode_words_are_deterministic():
    ids = block_token_ids(3, 20, RANGE)
    text = ids_to_text(ids)
    assert text == ids_to_text(ids) and len(text.split()) == 20
    assert ids_to_text(ids[:10]) == " ".join(text.split()[:10])
    with pytest.raises(ValueError):
        TokenRange(5, 5)
    assert TokenRange.parse("10:20") == TokenRange(10, 20)


def test_prefix_groups_keep_the_largest_sharing_groups_at_their_times():
    from mooncake.bench.prompts import TokenRange
    from mooncake.bench.trace import TraceRecord, TraceScaling, trace_sessions

    recs = [TraceRecord(line_no=i + 1, timestamp_ms=t, input_length=2 * 4, output_length=3, hash_ids=ids)
            for i, (t, ids) in enumerate([(0, (1, 2)), (10, (7, 8)), (20, (1, 3)), (30, (9,)), (40, (1, 4)),
                                         (50, (7, 5))])]
    got = trace_sessions(recs, TraceScaling(block_tokens=4, prefix_groups=2), TokenRange(1000, 30000))
    assert [s.session_id for s in got] == ["trace-1", "trace-2", "trace-3", "trace-5", "trace-6"]
    assert [s.arrival_s for s in got] == [0.0, 0.01, 0.02, 0.04, 0.05]
    assert got[0].turns[0][:4] == got[2].turns[0][:4] != got[1].turns[0][:4]


def test_salt_changes_every_block_but_keeps_the_sharing():
    assert block_token_ids(42, 16, RANGE, salt=0) == block_token_ids(42, 16, RANGE)
    a, b = expand_prompt(rec([5, 9]), 16, RANGE, salt=7), expand_prompt(rec([5, 11]), 16, RANGE, salt=7)
    assert common_prefix(a, b) >= 16  # the shared block is still shared within one salt
    plain = expand_prompt(rec([5, 9]), 16, RANGE)
    assert common_prefix(a, plain) == 0  # nothing in common with another salt, first token included
    assert all(RANGE.lo <= t < RANGE.hi for t in a)
    sessions = trace_sessions([rec([5, 9])], TraceScaling(block_tokens=16, salt=3), RANGE)
    assert list(sessions[0].turns[0]) == expand_prompt(rec([5, 9]), 16, RANGE, salt=3)


def test_unique_prefixes_keep_lengths_and_arrivals_and_share_no_block():
    recs = [rec([1, 2], ts=0, line_no=1), rec([1, 3], ts=10, line_no=2), rec([1, 2, 4], ts=20, line_no=3)]
    plain = trace_sessions(recs, TraceScaling(block_tokens=8), RANGE)
    unique = trace_sessions(recs, TraceScaling(block_tokens=8, unique_prefixes=True), RANGE)
    assert [len(s.turns[0]) for s in unique] == [len(s.turns[0]) for s in plain]
    assert [s.arrival_s for s in unique] == [s.arrival_s for s in plain]
    assert common_prefix(plain[0].turns[0], plain[2].turns[0]) == 16
    blocks = [tuple(s.turns[0][i:i + 8]) for s in unique for i in range(0, len(s.turns[0]), 8)]
    assert len(set(blocks)) == len(blocks)
    twice = trace_sessions(recs, TraceScaling(block_tokens=8, unique_prefixes=True, min_span_s=0.05), RANGE)
    blocks = [tuple(s.turns[0][i:i + 8]) for s in twice for i in range(0, len(s.turns[0]), 8)]
    assert len(twice) > len(recs) and len(set(blocks)) == len(blocks)  # repetitions share nothing either
