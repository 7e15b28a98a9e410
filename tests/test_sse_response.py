"""An event stream whose client stopped reading ends after ``[frontend] sse_write_timeout_s``:
the response's body (and with it the request, mooncake/api/routes.py ``_outputs``) is closed,
so the server holds what arrived in that time, not the whole output."""

from __future__ import annotations

import asyncio
import time

from mooncake.api.sse import SSEResponse


async def test_a_client_that_stops_reading_ends_the_stream_after_the_write_timeout():
    closed = asyncio.Event()
    produced = 0

    async def events():
        nonlocal produced
        try:
            while True:
                produced += 1
                yield b"data: {}\n\n"
                await asyncio.sleep(0)
        finally:
            closed.set()

    taken: list[dict] = []
    stalled = asyncio.Event()

    async def send(message: dict) -> None:  # the client takes the headers and two events, then nothing
        if len(taken) >= 3:
            stalled.set()
            await asyncio.Event().wait()
        taken.append(message)

    response = SSEResponse(events(), write_timeout_s=0.3)
    t0 = time.monotonic()
    await asyncio.wait_for(response.stream_response(send), 10)
    assert stalled.is_set() and closed.is_set()
    assert 0.3 <= time.monotonic() - t0 < 5
    assert produced == 3  # nothing more was asked of the request once the client stalled


async def test_a_client_that_reads_gets_the_whole_stream():
    async def events():
        for i in range(5):
            yield f"data: {i}\n\n".encode()

    taken: list[dict] = []

    async def send(message: dict) -> None:
        await asyncio.sleep(0.01)
        taken.append(message)

    await SSEResponse(events(), write_timeout_s=0.3).stream_response(send)
    assert taken[0]["type"] == "http.response.start" and taken[-1] == {"type": "http.response.body", "body": b"",
                                                                        "more_body": False}
    assert b"".join(m.get("body", b"") for m in taken) == b"".join(f"data: {i}\n\n".encode() for i in range(5))


async def test_ending_a_stream_ends_its_pieces_at_once():
    """However the stream ends (a stalled client, a disconnect), the pieces, and with them the
    requests, are closed then, not when the generator is collected."""
    from mooncake.api.sse import Piece, sse_stream

    ended = asyncio.Event()

    async def pieces():
        try:
            while True:
                yield Piece("x")
                await asyncio.sleep(0)
        finally:
            ended.set()

    stream = sse_stream(pieces(), "id", "m", False, lambda: None, lambda e: {})
    assert (await anext(stream)).startswith(b"data: ")
    await stream.aclose()
    assert ended.is_set()
