"""The wire protocol: round trips, and decoding any frames raises ProtocolError and nothing else."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake import protocol as P

BLOCK = (2, 2, 1, 4, 8)


def test_messages_round_trip_with_tensor_frames():
    kv = torch.randn(3, *BLOCK)
    msg, tensors = P.decode(P.encode(P.KVTransfer("r#1", 2), list(kv.unbind(0))), block_shape=BLOCK)
    assert msg == P.KVTransfer("r#1", 2, [P.TensorSpec("float32", BLOCK)] * 3)
    assert torch.equal(torch.stack(tensors), kv)
    reg = P.Register("prefill", "p0", P.NodeInfo("n0", 7, P.ModelFacts("m", 16, 2048, 100, BLOCK), 10, 99))
    assert P.decode(P.encode(reg))[0] == reg
    tok = P.TokenEvent("r#1", 4, [1, 2], P.FinishReason.LENGTH)
    assert P.decode(P.encode(tok))[0].finished is P.FinishReason.LENGTH
    step = P.TokenStep([tok, P.TokenEvent("r#2", 0, [3], logprobs=[P.Logprob(-0.5, [3], [-0.5])])])
    assert P.decode(P.encode(step))[0] == step


@pytest.mark.parametrize("frames", [
    [],
    [b"\x81\xa1t\xa2ok" + b"\x81\xa1a" * 100_000],
    [msgspec.msgpack.encode({"t": "kv", "req_id": "r", "first_block": 0, "tensors": [["float32", [-4, 2]]]}), b""],
    [msgspec.msgpack.encode({"t": "kv", "req_id": "r", "first_block": 0, "tensors": [["float32", [2, 2]]]}),
     b"\0" * 16],
    [msgspec.msgpack.encode({"t": "kv", "req_id": "r", "first_block": 0, "tensors": [["object", list(BLOCK)]]}),
     b"\0" * 8],
    [msgspec.msgpack.encode({"t": "put", "hashes": [], "tensors": [["float32", [2 ** 62, 2 ** 62]]]}), b""],
    [object()],
])
def test_known_malformed_frames_are_protocol_errors(frames):
    with pytest.raises(P.ProtocolError):
        P.decode(frames, block_shape=BLOCK)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(st.lists(st.binary(max_size=128), min_size=1, max_size=3),
       st.sampled_from([t.__struct_config__.tag for t in P.Message.__args__]),
       st.dictionaries(st.text(max_size=10), st.recursive(
           st.one_of(st.none(), st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(), st.text(max_size=10),
                     st.binary(max_size=10)),
           lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=5), x, max_size=3)), max_size=5))
def test_any_frames_decode_or_raise_protocol_error(raw, tag, fields):
    for frames in (raw, [msgspec.msgpack.encode({**fields, "t": tag}), *raw[1:]]):
        try:
            P.decode(frames, block_shape=BLOCK if tag == "kv" else None)
        except P.ProtocolError:
            pass
