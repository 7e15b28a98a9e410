"""Shared-prefix workload, arrivals, request bodies, config validation, progress bar."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mooncake.bench.arrivals import ArrivalSpec, arrival_times
from mooncake.bench.client import RequestRecord
from mooncake.bench.config import BenchConfig
from mooncake.bench.conversation import Conversation, RequestOptions
from mooncake.bench.progress import ProgressBar
from mooncake.bench.prompts import TokenRange, ids_to_text
from mooncake.bench.workloads import Session, SharedPrefixSpec, shared_prefix_sessions

RANGE = TokenRange(1000, 30000)


def test_shared_prefix_structure():
    spec = SharedPrefixSpec(groups=3, sessions_per_group=2, prefix_tokens=20, suffix_tokens=5,
                            turns=2, output_tokens=7, seed=1)
    sessions = shared_prefix_sessions(spec, RANGE)
    assert [s.session_id for s in sessions] == ["g0-s0", "g1-s0", "g2-s0", "g0-s1", "g1-s1", "g2-s1"]
    by_id = {s.session_id: s for s in sessions}
    a, b, c = by_id["g0-s0"], by_id["g0-s1"], by_id["g1-s0"]
    assert a.turns[0][:20] == b.turns[0][:20] and a.turns[0][20:] != b.turns[0][20:]
    assert a.turns[0][:20] != c.turns[0][:20]
    assert [len(t) for t in a.turns] == [25, 5] and a.max_tokens == (7, 7)
    assert all(RANGE.lo <= t < RANGE.hi for s in sessions for turn in s.turns for t in turn)
    assert shared_prefix_sessions(spec, RANGE) == sessions  # deterministic
    other = shared_prefix_sessions(SharedPrefixSpec(groups=3, sessions_per_group=2, prefix_tokens=20,
                                                    suffix_tokens=5, turns=2, seed=2), RANGE)
    assert other[0].turns != sessions[0].turns
    with pytest.raises(ValueError):
        SharedPrefixSpec(turns=2, suffix_tokens=0)
    with pytest.raises(ValueError):
        SharedPrefixSpec(groups=0)


def sessions(n, arrivals=None):
    return [Session(f"s{i}", ((1,),), (1,), None if arrivals is None else arrivals[i]) for i in range(n)]


def test_arrivals():
    assert arrival_times(ArrivalSpec("rate", rate=4.0), sessions(3)) == [0.0, 0.25, 0.5]
    assert arrival_times(ArrivalSpec("concurrency", concurrency=2), sessions(3)) == [0.0] * 3
    assert arrival_times(ArrivalSpec("trace"), sessions(2, [0.0, 1.5])) == [0.0, 1.5]
    with pytest.raises(ValueError, match="timestamps"):
        arrival_times(ArrivalSpec("trace"), sessions(2))
    p = arrival_times(ArrivalSpec("poisson", rate=50.0, seed=3), sessions(4000))
    assert p == arrival_times(ArrivalSpec("poisson", rate=50.0, seed=3), sessions(4000))
    assert p != arrival_times(ArrivalSpec("poisson", rate=50.0, seed=4), sessions(4000))
    gaps = np.diff(p)
    assert p[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.06)  # exponential gaps of mean 1/rate
    assert gaps.std() == pytest.approx(1 / 50, rel=0.1)
    for bad in (dict(kind="rate"), dict(kind="poisson", rate=0), dict(kind="concurrency"),
                dict(kind="trace", concurrency=0), dict(kind="nope")):
        with pytest.raises(ValueError):
            ArrivalSpec(**bad)


def test_conversation_bodies():
    s = Session("x", ((1001, 1002), (1003,)), (5, 6))
    conv = Conversation(s, RequestOptions(model="m", ignore_eos=True), encode=lambda t: [7] * len(t.split()))
    b = conv.body()
    assert b == {"model": "m", "max_tokens": 5, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True, "prompt": [1001, 1002]}
    assert conv.prompt_token_count() == 2
    conv.record_answer(" a b c")
    assert conv.body()["prompt"] == [1001, 1002, 7, 7, 7, 1003] and conv.body()["max_tokens"] == 6

    text = Conversation(s, RequestOptions(model="m", prompt_mode="text"))
    assert text.body()["prompt"] == ids_to_text([1001, 1002]) and "ignore_eos" not in text.body()
    text.record_answer(" yes")
    assert text.body()["prompt"] == ids_to_text([1001, 1002]) + " yes\n" + ids_to_text([1003])
    assert text.prompt_token_count() is None

    chat = Conversation(s, RequestOptions(model="m", endpoint="chat", prompt_mode="text"))
    chat.record_answer("ok")
    assert chat.body()["messages"] == [{"role": "user", "content": ids_to_text([1001, 1002])},
                                       {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": ids_to_text([1003])}]
    no_tok = Conversation(s, RequestOptions(model="m"))
    no_tok.record_answer("a")
    with pytest.raises(RuntimeError, match="tokenizer"):
        no_tok.body()
    with pytest.raises(ValueError):
        RequestOptions(model="m", endpoint="chat", prompt_mode="tokens")


def test_config_validation_and_defaults():
    assert BenchConfig(trace_path="t.jsonl").arrival_spec().kind == "trace"
    sp = BenchConfig(workload="shared-prefix")
    assert sp.arrival_spec() == ArrivalSpec(kind="concurrency", concurrency=4)
    assert BenchConfig(workload="shared-prefix", api_key="secret").to_dict()["api_key"] == "***"
    for bad in (dict(workload="trace"), dict(workload="shared-prefix", max_requests=0),
                dict(workload="shared-prefix", arrival=ArrivalSpec("trace")),
                dict(workload="shared-prefix", goodput_slos_ms={"foo": 1.0}),
                dict(workload="shared-prefix", endpoint="chat")):
        with pytest.raises(ValueError):
            BenchConfig(**bad)


def test_progress_bar():
    out = io.StringIO()
    bar = ProgressBar(4, stream=out)
    for rec in (RequestRecord(0, "s", 0, 0.0, ok=True), RequestRecord(1, "s", 0, 0.0, status=429)):
        bar.update(rec)
    bar.bar.refresh()
    assert "2/4" in out.getvalue() and "ok=1, 429=1, err=0" in out.getvalue()
    bar.update(RequestRecord(2, "s", 0, 0.0, status=500))
    bar.close()
    assert bar.done == 3 and "3/4" in out.getvalue() and "ok=1, 429=1, err=1" in out.getvalue()
    quiet = io.StringIO()
    ProgressBar(1, enabled=False, stream=quiet).close()
    assert quiet.getvalue() == ""
