"""A pipeline stage's activation inbox (issue 12): hidden states are used only from the attempt's
stage before, in order, intact; everything else is dropped or fails the stage."""

from __future__ import annotations

import pytest
import torch

from mooncake import protocol as P
from mooncake.kv.integrity import checksums
from mooncake.roles import prefill_stage
from mooncake.roles.prefill_stage import ActivationInbox, StageError

TOKEN = b"t" * 16


def frames(start: int, end: int, token: bytes = TOKEN, corrupt: bool = False, req_id: str = "r#1") -> list:
    hidden = torch.arange((end - start) * 4, dtype=torch.float32).view(end - start, 4)
    msg = P.Activations(req_id, start, end, token=token, checksums=checksums([hidden]))
    if corrupt:
        hidden = hidden + 1
    return P.encode(msg, [hidden])


def inbox() -> ActivationInbox:
    return ActivationInbox(lambda rid: rid == "r#1")


def never() -> bool:
    return False


async def test_chunks_arrive_in_order_and_intact():
    box = inbox()
    box.on_frames(frames(0, 3), None)
    box.on_frames(frames(3, 5), None)
    assert (await box.get("r#1", TOKEN, 0, never)).shape == (3, 4)
    assert (await box.get("r#1", TOKEN, 3, never)).tolist()[0] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("bad, why", [(dict(token=b"x" * 16), "token"), (dict(corrupt=True), "checksum")])
async def test_forged_or_corrupt_activations_fail_the_stage(bad, why):
    box = inbox()
    box.on_frames(frames(0, 3, **bad), None)
    with pytest.raises(StageError, match=why):
        await box.get("r#1", TOKEN, 0, never)


async def test_a_chunk_out_of_order_fails_the_stage():
    box = inbox()
    box.on_frames(frames(3, 5), None)
    with pytest.raises(StageError, match="where 0.. was due"):
        await box.get("r#1", TOKEN, 0, never)


async def test_malformed_and_unknown_messages_are_dropped(monkeypatch):
    monkeypatch.setattr(prefill_stage, "ACTIVATION_TIMEOUT_S", 0.3)
    box = inbox()
    box.on_frames(frames(0, 3, req_id="other#1"), None)  # an attempt this instance does not hold
    box.on_frames([b"\x00garbage"], None)
    box.on_frames(P.encode(P.Abort("r#1")), None)  # not activations
    msg = P.Activations("r#1", 0, 2, token=TOKEN)  # rows do not match the positions
    box.on_frames(P.encode(msg, [torch.zeros(3, 4)]), None)
    with pytest.raises(StageError, match="no activations"):
        await box.get("r#1", TOKEN, 0, never)
    assert "other#1" not in box._queues


async def test_an_aborted_stage_stops_waiting():
    with pytest.raises(StageError, match="aborted"):
        await inbox().get("r#1", TOKEN, 0, lambda: True)
