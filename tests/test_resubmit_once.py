"""Registering again answers each Submit once (issue 52, finding 1): a Submit the frontend sent
after its Register, asked again when the Registered arrives, is not answered twice by the
conductor, and a repeated answer never makes the frontend abort an attempt it drives; an answer
to an attempt it gave up on still releases the booking."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq.asyncio

from mooncake import protocol as P
from mooncake.conductor import Conductor
from mooncake.config import Config
from mooncake.frontend import Frontend, Request
from mooncake.frontend.attempt_driver import AttemptDriver

FACTS = P.ModelFacts("m@x/float32", 16, 128, 1000, (2, 2, 1, 16, 8))


class Wire:
    """Stands in for the sockets between frontend ``f0`` and the conductor: what the frontend
    sends the conductor handles at once; what the conductor sends the frontend waits in
    ``inbox``, in order, until the test delivers it."""

    def __init__(self, conductor: Conductor) -> None:
        self.conductor = conductor
        self.inbox: list[P.Msg] = []
        self.to_workers: list[tuple[str, P.Msg]] = []

    async def send(self, msg: P.Msg, beat: bool = False) -> None:  # the frontend's link
        c = self.conductor
        handler = {P.Submit: c._on_submit, P.Claims: c._on_claims, P.Release: c._on_release}[type(msg)]
        handler(c.cluster.get(msg.node_id), msg)

    def send_to(self, node_id: str, msg: P.Msg) -> None:  # the conductor's router
        if node_id == "f0":
            self.inbox.append(msg)
        else:
            self.to_workers.append((node_id, msg))

    def take(self, kind: type) -> list[P.Msg]:
        """The frontend's messages of ``kind`` (taken out of the inbox, the rest stay)."""
        out = [m for m in self.inbox if isinstance(m, kind)]
        self.inbox = [m for m in self.inbox if not isinstance(m, kind)]
        return out


class Router:
    def __init__(self, wire: Wire) -> None:
        self.send = wire.send_to

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def register(c: Conductor, node_id: str, role: str, **endpoints: str) -> None:
    info = P.NodeInfo("n0", 1, FACTS if role in ("prefill", "decode") else None, num_blocks=64)
    assert isinstance(c.membership.register(node_id.encode(), P.Register(role, node_id, info, endpoints),
                                            time.monotonic()), P.Registered)


@pytest.fixture
async def pair():
    conductor = Conductor(Config(), model_name="m")
    wire = Wire(conductor)
    conductor.router = Router(wire)
    register(conductor, "p0", "prefill", orders="tcp://127.0.0.1:3")
    register(conductor, "d0", "decode", kv="tcp://127.0.0.1:1", orders="tcp://127.0.0.1:4")
    register(conductor, "f0", "frontend", tokens="tcp://127.0.0.1:9")
    f = Frontend(Config(), tokenizer=None, model_name="m", node_id="f0")
    f.conductor.link = wire
    f.conductor.view = P.ClusterView("c0", FACTS, True, {"prefill": 1, "decode": 1})
    f.driver = AttemptDriver(zmq.asyncio.Context.instance(), None, "f0", "tcp://127.0.0.1:9", 1 << 20,
                             f._on_prefilled, f._on_failed)
    f.driver.sent = []  # what would go to the workers: (node id, message)
    f.driver._send = lambda worker, msg: f.driver.sent.append((worker.node_id, msg))
    f.conductor.claims = f.driver.claims
    yield f, conductor, wire
    for t in f._tasks:
        t.cancel()
    await conductor.close()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def aborts(f: Frontend, conductor_sent: list[tuple[str, P.Msg]], wire_id: str) -> list:
    """Every order to drop ``wire_id`` on a worker, the frontend's and the conductor's."""
    return [(n, m) for n, m in f.driver.sent + conductor_sent if m == P.Abort(wire_id)]


async def test_a_submit_sent_after_registering_again_is_answered_once_and_its_attempt_runs_on(pair):
    f, conductor, wire = pair
    # the frontend registers again (the conductor asked it to): the conductor has the Register ...
    register(conductor, "f0", "frontend", tokens="tcp://127.0.0.1:9")
    # ... and a request's Submit, sent after it and before the Registered was read, is answered
    placing = asyncio.create_task(f.submit([1, 2, 3], P.Sampling(max_tokens=8)))
    await settle()
    (first,) = wire.inbox
    assert isinstance(first, P.Admitted) and not placing.done()
    await f.conductor._resubmit()  # the Registered is read: the frontend asks again what awaits an answer
    f.conductor.handle(wire.inbox.pop(0))  # the first answer
    req = await asyncio.wait_for(placing, 5)
    assert isinstance(req, Request) and req.wire_id in f.driver.attempts  # driven
    for msg in wire.take(P.Admitted) + wire.take(P.Refused):  # any answer to the Submit asked again
        f.conductor.handle(msg)
    await f.conductor.flush()  # whatever the frontend would release goes now
    assert not aborts(f, wire.to_workers, req.wire_id)  # nobody drops the attempt the frontend drives
    assert req.wire_id in conductor.attempts and not req.done and f.driver.attempts[req.wire_id]


async def test_the_conductor_answers_a_submit_asked_again_only_after_its_frontend_registered_again(pair):
    f, conductor, wire = pair
    msg = P.Submit("r#1", "f0", [1, 2, 3], [], b"", P.Sampling(max_tokens=8), 0, new_request=True)
    await wire.send(msg)
    (admitted,) = wire.take(P.Admitted)
    await wire.send(msg)  # asked again on the same registration: the answer is on its way already
    assert not wire.take(P.Admitted) and not wire.take(P.Refused)
    register(conductor, "f0", "frontend", tokens="tcp://127.0.0.1:9")  # (another connection: it may be lost)
    await wire.send(msg)
    assert wire.take(P.Admitted) == [admitted] and len(conductor.attempts) == 1


async def test_a_repeated_answer_to_a_driven_attempt_is_ignored_and_a_late_one_still_released(pair):
    f, conductor, wire = pair
    req = asyncio.create_task(f.submit([1, 2, 3], P.Sampling(max_tokens=8)))
    await settle()
    (admitted,) = wire.take(P.Admitted)
    f.conductor.handle(admitted)
    f.conductor.handle(admitted)  # a repeat while the answer is being delivered
    req = await asyncio.wait_for(req, 5)
    f.conductor.handle(admitted)  # ... and once the attempt is driven
    assert not f.conductor.ended and req.wire_id in f.driver.attempts
    f.cancel(req.req_id)  # the attempt ends here: an answer after that is to an attempt given up on
    f.conductor.ended.clear()
    f.conductor.handle(admitted)
    assert [(e.wire_id, e.abort) for e in f.conductor.ended] == [(req.wire_id, True)]
