"""The conductor benchmark's own logic: the stand-in decode's token stream, the stand-in
pools' LRU, the profile's components, and the prompt mix."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from conductor_profile import IDLE, component  # noqa: E402
from standin_workers import LRUBlocks, step, token_events  # noqa: E402

from mooncake import protocol as P  # noqa: E402


def decode_request(max_tokens: int, num_generated: int = 0) -> P.DecodeRequest:
    return P.DecodeRequest("r#1", [1, 2, 3], [], b"", P.Sampling(max_tokens=max_tokens), num_generated)


def test_token_events_cover_every_index_after_the_prefills_token_once():
    for per_event in (1, 3, 15, 40):
        events = token_events(decode_request(16), per_event)
        covered = [e.index + k for e in events for k in range(len(e.tokens))]
        assert covered == list(range(1, 16))
        assert [e.finished for e in events] == [None] * (len(events) - 1) + [P.FinishReason.LENGTH]


def test_token_events_after_a_migration_start_past_the_earlier_attempts_tokens():
    events = token_events(decode_request(16, num_generated=10), 2)
    assert [e.index for e in events] == [11, 13, 15] and len(events[-1].tokens) == 1
    assert token_events(decode_request(11, num_generated=10), 1) == []  # the prefill's token was the last


def test_a_stand_in_decode_step_gives_each_request_its_next_event_and_drops_the_finished():
    batch = {"a": iter(token_events(decode_request(3), 1)), "b": iter(token_events(decode_request(4), 1)),
             "c": iter([])}  # a request with nothing left to send
    first = step(batch)
    assert [(e.index, e.finished) for e in first] == [(1, None), (1, None)] and list(batch) == ["a", "b"]
    second = step(batch)
    assert [(e.index, e.finished) for e in second] == [(2, P.FinishReason.LENGTH), (2, None)] and list(batch) == ["b"]
    assert [(e.index, e.finished) for e in step(batch)] == [(3, P.FinishReason.LENGTH)] and not batch


def test_lru_blocks_count_leading_hits_and_evict_the_least_recently_used():
    lru = LRUBlocks(3)
    assert lru.insert([b"a", b"b"]) == ([b"a", b"b"], [])
    assert lru.leading_hits([b"a", b"x", b"b"]) == 1  # stops at the first miss; touches a
    assert lru.insert([b"b", b"c", b"d"]) == ([b"c", b"d"], [b"a"])
    assert lru.leading_hits([b"b", b"c", b"d"]) == 3


def test_profile_components_by_path_or_builtin_description():
    assert component("~:0(<method 'poll' of 'select.epoll' objects>)") == IDLE
    assert component("/x/mooncake/blocks.py:40(hash_blocks)") == "block hashing"
    assert component("<built-in method _hashlib.openssl_sha256>") == "block hashing"
    assert component("/x/mooncake/sched/scheduler.py:10(plan)") == "scheduler + KV index"
    assert component("<method 'send' of 'zmq.backend.cython._zmq.Socket' objects>") == "ZeroMQ + wire protocol"
    assert component("/v/site-packages/uvicorn/protocols/http/h11_impl.py:1(data_received)").startswith("HTTP")
    assert component("/v/site-packages/pydantic/main.py:1(validate)").startswith("FastAPI")
    assert component("/x/mooncake/api/text_stream.py:1(push)").startswith("detokenize")
    assert component("/usr/lib/python3.12/functools.py:1(wraps)") == "other"


def test_prompts_mix_lengths_and_shared_prefixes():
    from conductor_load import prompts

    texts = prompts(32)
    lengths = [len(t.split()) for t in texts]
    assert min(lengths) >= 200 and max(lengths) <= 2000
    assert texts[0].split()[:50] == texts[8].split()[:50]  # same shared prefix (group 0)
    assert texts[1].split()[:50] != texts[9].split()[:50]  # odd ones share nothing
    assert prompts(32) == texts  # deterministic
