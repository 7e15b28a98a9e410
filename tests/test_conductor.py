"""The conductor's request bookkeeping without workers: admission bounds, abort, index events."""

from __future__ import annotations

import pytest

from mooncake import protocol as P
from mooncake.api.errors import APIError
from mooncake.config import Config
from mooncake.roles.conductor import Conductor


@pytest.fixture
async def conductor():
    cfg = Config()
    cfg.conductor.max_requests = 2
    c = Conductor(cfg, tokenizer=None, model_name="m")
    c.model_facts = {"model_id": "m@x/float32", "block_tokens": 16, "max_model_len": 128, "vocab_size": 1000}
    c.cluster.upsert("p0", "prefill", "n0", b"p0", {}, {}, 0)
    c.cluster.upsert("d0", "decode", "n0", b"d0", {"kv": "tcp://127.0.0.1:1"}, {}, 0)
    yield c
    await c.close()


async def test_requests_in_flight_are_bounded(conductor):
    a = conductor.submit([1, 2, 3], P.Sampling(max_tokens=4))
    conductor.submit([4, 5, 6], P.Sampling(max_tokens=4))
    with pytest.raises(APIError) as e:
        conductor.submit([7, 8, 9], P.Sampling(max_tokens=4))
    assert e.value.status == 503 and e.value.code == "overloaded" and e.value.retry_after_s
    assert a.wire_id in conductor.cluster.get("d0").assigned and a.wire_id in conductor.cluster.get("p0").work
    conductor.abort(a.req_id)  # frees a slot and the instances' bookkeeping
    assert a.wire_id not in conductor.cluster.get("d0").assigned
    assert a.wire_id not in conductor.cluster.get("p0").work and a.wire_id not in conductor.attempts
    conductor.submit([7, 8, 9], P.Sampling(max_tokens=4))


async def test_prompt_checks_and_max_tokens_clamp(conductor):
    with pytest.raises(APIError) as e:
        conductor.submit(list(range(128)), P.Sampling(max_tokens=4))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        conductor.submit([5000], P.Sampling(max_tokens=4))
    assert e.value.param == "prompt"
    req = conductor.submit(list(range(100)), P.Sampling(max_tokens=500))
    assert req.sampling.max_tokens == 28


async def test_block_events_feed_the_index(conductor):
    await conductor._handle(b"p0", P.BlockEvent("p0", "stored", "device", [b"a" * 32, b"b" * 32]))
    await conductor._handle(b"p0", P.BlockEvent("p0", "removed", "device", [b"a" * 32]))
    assert conductor.index.holders(b"b" * 32) == {"p0": "device"} and len(conductor.index) == 1
    conductor._declare_dead(conductor.cluster.get("p0"))
    assert len(conductor.index) == 0 and conductor.cluster.get("p0") is None


async def test_messages_of_an_earlier_attempt_are_ignored(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    old = req.wire_id
    decode = conductor.cluster.get("d0")
    conductor._migrate(req, "test")  # a second attempt on the same instances
    assert req.wire_id != old and req.migrations == 1
    await conductor._handle(b"d0", P.TokenEvent(old, [5, 6], ""))  # late tokens of attempt 1
    await conductor._handle(b"p0", P.Failed(old, "p0", "late failure of attempt 1"))
    assert req.generated == [] and req.migrations == 1 and not req.done
    await conductor._handle(b"p0", P.PrefillDone(req.wire_id, "p0", 7, 0, 3, 0.01))
    await conductor._handle(b"d0", P.TokenEvent(req.wire_id, [8], ""))
    assert req.generated == [7, 8] and decode.assigned


async def test_decode_tokens_that_overtake_the_first_token_wait_for_it(conductor):
    req = conductor.submit([1, 2, 3], P.Sampling(max_tokens=8))
    await conductor._handle(b"d0", P.TokenEvent(req.wire_id, [8], ""))
    assert req.generated == []
    await conductor._handle(b"p0", P.PrefillDone(req.wire_id, "p0", 7, 0, 3, 0.01))
    assert req.generated == [7, 8]
