"""A frontend's side of a request without a conductor or workers: tokens in index order from
its decode only, duplicates dropped, failures moving or ending the request, bounded retries,
timeouts, what a moved request resumes with, the release of what ended here."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq.asyncio

from mooncake import protocol as P
from mooncake.blocks import hash_blocks
from mooncake.config import Config
from mooncake.frontend import Finished, Frontend, Rejection, Request, Tokens
from mooncake.frontend.attempt_driver import AttemptDriver
from mooncake.frontend.request import RequestStatus, TransitionError

FACTS = P.ModelFacts("m@x/float32", 16, 128, 1000, (2, 2, 1, 16, 8))
ROUTE = P.Route(P.WorkerRef("d0", "decode", "tcp://127.0.0.1:4", "tcp://127.0.0.1:14"),
                [P.WorkerRef("p0", "prefill", "tcp://127.0.0.1:3")], b"k" * 16)


class Link:
    """Stands in for the frontend's link to the conductor: records what it sends and answers
    each Submit (``refuse``: with a Refused)."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.sent: list[P.Msg] = []
        self.refuse: P.Refused | None = None

    async def send(self, msg: P.Msg, beat: bool = False) -> None:
        self.sent.append(msg)
        if isinstance(msg, P.Submit):
            answer = P.Refused(msg.wire_id, **{f: getattr(self.refuse, f) for f in ("status", "reason", "message")}) \
                if self.refuse else P.Admitted(msg.wire_id, ROUTE, msg.sampling.max_tokens)
            asyncio.get_running_loop().call_soon(self.frontend.conductor.handle, answer)

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]

    def close(self) -> None:
        pass


@pytest.fixture
async def frontend():
    f = Frontend(Config(), tokenizer=None, model_name="m", node_id="f0")
    f.conductor.link = Link(f)
    f.conductor.view = P.ClusterView("c0", FACTS, True, {"prefill": 1, "decode": 1})
    f.driver = AttemptDriver(zmq.asyncio.Context.instance(), None, "f0", "tcp://127.0.0.1:9", 1 << 20,
                             f._on_prefilled, f._on_failed)
    f.driver.sent = []  # what would go to the workers: (node id, message)
    f.driver._send = lambda worker, msg: f.driver.sent.append((worker.node_id, msg))
    yield f
    for t in f._tasks:
        t.cancel()


def events(req: Request) -> list:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def start(f: Frontend, req: Request, first: int = 7) -> None:
    """What the workers report as the attempt runs to its first token."""
    f.driver.handle("d0", P.Reserved(req.wire_id, "d0"))
    f.driver.handle("p0", P.PrefillDone(req.wire_id, "p0", first, 0, len(req.tokens), 0.01))


def aborted(f: Frontend, wire_id: str) -> set[str]:
    return {n for n, m in f.driver.sent if m == P.Abort(wire_id)}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_request_streams_from_its_first_token_to_the_decode_s_last(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=4))
    assert isinstance(req, Request) and req.status is RequestStatus.PLACED
    submit, = frontend.conductor.link.of(P.Submit)
    assert submit.node_id == "f0" and submit.n_tokens == 3 and submit.num_generated == 0
    assert not submit.tokens and frontend.driver.attempts[submit.wire_id].submit.tokens == [1, 2, 3]  # for workers
    start(frontend, req)
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 1, [8, 9]))
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 3, [10], P.FinishReason.LENGTH))
    assert req.generated == [7, 8, 9, 10] and req.done and events(req)[-1] == Finished(P.FinishReason.LENGTH)
    assert req.req_id not in frontend.requests
    (ended,) = frontend.conductor.ended
    assert ended.wire_id == submit.wire_id and not ended.abort and ended.decoded == 3


async def test_tokens_from_another_decode_or_an_ended_attempt_are_refused(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    start(frontend, req)
    frontend._on_tokens("d9", P.TokenEvent(req.wire_id, 1, [66]))  # not its decode
    frontend._on_tokens("d0", P.TokenEvent("req-gone#1", 1, [66]))
    assert req.generated == [7] and frontend.metrics.tokens_refused._value.get() == 2


async def test_tokens_that_overtake_the_first_one_wait_for_it(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=3))
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 1, [8]))
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 2, [9], P.FinishReason.LENGTH))
    assert req.generated == [] and not req.done
    start(frontend, req)
    assert req.generated == [7, 8, 9] and req.done


async def test_tokens_are_emitted_in_index_order_and_duplicates_dropped(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    start(frontend, req)
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 3, [11]))  # overtook index 1-2: held
    assert req.generated == [7]
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 1, [9, 10]))
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 2, [10]))  # a duplicate
    assert req.generated == [7, 9, 10, 11]
    assert [e.ids for e in events(req) if isinstance(e, Tokens)] == [[7], [9, 10], [11]]


async def test_cancel_releases_the_attempt_and_has_its_workers_drop_it(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    frontend.cancel(req.req_id)
    frontend.cancel(req.req_id)  # idempotent
    assert req.done and [(e.wire_id, e.abort) for e in frontend.conductor.ended] == [(req.attempt.wire_id, False)]
    assert aborted(frontend, req.wire_id) == {"p0", "d0"}  # by the frontend, which drives it
    await frontend.conductor.flush()
    (release,) = frontend.conductor.link.of(P.Release)
    assert release.node_id == "f0" and len(release.ended) == 1 and not frontend.conductor.ended


async def test_token_ids_outside_the_vocabulary_are_refused_before_the_conductor_is_asked(frontend):
    for tokens in ([1, 1000], [-1, 2]):
        r = await frontend.submit(tokens, P.Sampling())
        assert isinstance(r, Rejection) and r.status == 400 and r.param == "prompt" and r.reason == "invalid_prompt"
    assert not frontend.conductor.link.of(P.Submit) and not frontend.requests


async def test_a_refusal_is_the_client_s_error(frontend):
    frontend.conductor.link.refuse = P.Refused("", 503, "overloaded", "too many requests")
    r = await frontend.submit([1, 2, 3], P.Sampling())
    assert isinstance(r, Rejection) and r.status == 503 and r.reason == "overloaded" and not frontend.requests
    frontend.conductor.view = P.ClusterView("c0")
    r = await frontend.submit([1, 2, 3], P.Sampling())
    assert isinstance(r, Rejection) and r.reason == "no_workers"


async def test_fatal_failures_end_the_request_with_a_client_error(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    frontend.driver.handle("d0", P.Failed(req.wire_id, "d0", "bad temperature", P.FailureKind.FATAL, "temperature"))
    assert req.done and req.migrations == 0 and aborted(frontend, req.wire_id) == {"p0", "d0"}
    end = events(req)[-1]
    assert end.reason is P.FinishReason.ERROR and end.error.status == 400 and end.error.param == "temperature"


async def test_retries_are_bounded_and_preemptions_do_not_count(frontend):
    frontend.cfg.admission.max_migrations = 1
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    for _ in range(3):
        frontend._handle(P.AttemptEnded(req.wire_id, "preempted", "pool full"))
        await settle()
    assert req.attempts == 4 and req.migrations == 0 and not req.done
    frontend._handle(P.AttemptEnded(req.wire_id, "retry", "boom"))
    await settle()
    assert req.migrations == 1 and not req.done and req.attempts == 5
    frontend._handle(P.AttemptEnded(req.wire_id, "retry", "boom again"))
    assert req.done and events(req)[-1].error.status == 503


async def test_a_moved_request_resumes_with_its_tokens_and_their_hashes(frontend):
    req = await frontend.submit(list(range(20)), P.Sampling(max_tokens=30))
    start(frontend, req)
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 1, list(range(100, 112))))
    frontend._handle(P.AttemptEnded(req.wire_id, "retry", "decode died"))
    await settle()
    asked = frontend.conductor.link.of(P.Submit)[-1]
    msg = frontend.driver.attempts[asked.wire_id].submit
    assert msg.tokens == list(range(20)) + [7] + list(range(100, 112)) and msg.num_generated == 13
    assert asked.n_tokens == 33 and asked.num_generated == 13 and asked.hashes == msg.hashes
    assert msg.hashes == hash_blocks(msg.tokens, 16, FACTS.model_id) and msg.sampling.max_tokens == 30
    assert msg.wire_id.endswith("#2") and req.status is RequestStatus.PLACED


async def test_a_request_without_progress_moves_then_fails(frontend):
    frontend.cfg.admission.request_timeout_s = 10
    frontend.cfg.admission.max_migrations = 1
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    t0 = req.last_progress
    frontend.check_progress(t0 + 5)
    assert req.attempts == 1
    frontend.check_progress(t0 + 11)
    await settle()
    assert req.attempts == 2 and req.migrations == 1 and not req.done
    (release,) = frontend.conductor.link.of(P.Release)  # before the move was asked for, in the same wake-up
    assert aborted(frontend, release.ended[0].wire_id) == {"p0", "d0"}  # dropped where it runs
    frontend.check_progress(req.last_progress + 11)
    assert req.done and "no progress" in events(req)[-1].error.message


def test_the_state_machine_refuses_transitions_it_does_not_know():
    req = Request("r", [1], [], b"", P.Sampling(), 0.0)
    with pytest.raises(TransitionError):
        req.prefilled(1, 0, 0.0)
    with pytest.raises(TransitionError):
        req.accept(0, [1], 0.0)
    assert req.finish(P.FinishReason.ABORT) and not req.finish(P.FinishReason.STOP)


async def test_a_new_leader_without_workers_yet_does_not_make_the_frontend_forget_the_model(frontend):
    frontend.conductor.handle(P.ClusterView("c1", None, False, {"frontend": 1}))
    assert frontend.facts == FACTS and not frontend.ready and frontend.view.leader == "c1"
    r = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=4))
    assert isinstance(r, Request)


async def test_a_cancel_while_a_move_is_being_placed_releases_the_late_attempt(frontend):
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    link = frontend.conductor.link
    held: list[P.Admitted] = []
    link.send_original, answered = link.send, asyncio.Event()

    async def hold_answers(msg: P.Msg, beat: bool = False) -> None:  # the conductor answers the move only later
        link.sent.append(msg)
        if isinstance(msg, P.Submit):
            held.append(P.Admitted(msg.wire_id, ROUTE, 8))
            answered.set()

    link.send = hold_answers
    frontend.conductor.handle(P.AttemptEnded(req.wire_id, "retry", "decode died"))
    await asyncio.wait_for(answered.wait(), 5)
    frontend.cancel(req.req_id)
    assert req.done
    frontend.conductor.handle(held[0])
    await settle()
    # booked, never sent to a worker: released, nothing to abort
    assert (held[0].wire_id, False) in [(e.wire_id, e.abort) for e in frontend.conductor.ended]
    assert not aborted(frontend, held[0].wire_id)
    assert not frontend.requests and not frontend.attempts


async def test_with_no_conductor_heard_from_the_frontend_places_the_request_itself(frontend):
    frontend.conductor.heard_at -= 60  # silent for a minute: none leads
    refused = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=4))
    assert isinstance(refused, Rejection) and refused.reason == "no_conductor"  # no worker known to place on
    frontend.conductor.view = msgspec.structs.replace(frontend.conductor.view, workers=[
        P.WorkerRef("p0", "prefill", "tcp://127.0.0.1:1"), P.WorkerRef("d0", "decode", "tcp://127.0.0.1:2", "tcp://k")])
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=4))
    assert isinstance(req, Request) and not frontend.conductor.link.of(P.Submit)  # the conductor was not asked
    assert req.wire_id.endswith("#2")  # #1 stays the conductor's, if it ever was
    (node, reserve), = frontend.driver.sent
    assert node == "d0" and isinstance(reserve, P.DecodeRequest) and reserve.fallback
    start(frontend, req)
    assert isinstance(events(req)[0], Tokens)
    frontend.cancel(req.req_id)
    assert aborted(frontend, req.wire_id) == {"p0", "d0"} and not frontend.driver.attempts
    # the conductor hears only of the wire ids it may have placed (#1, in case), not of this attempt
    assert req.wire_id not in {e.wire_id for e in frontend.conductor.ended} and not frontend.conductor.done_prefills
    assert frontend.metrics.fallback_routed._value.get() == 1


async def test_registering_again_tells_the_conductor_every_attempt_driven_here_before_asking_again(frontend):
    frontend.conductor.claims = frontend.driver.claims
    placed = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=8))
    waiting = await frontend.submit([4, 5, 6], P.Sampling(max_tokens=8))
    start(frontend, placed)
    frontend.conductor._placing["w#1"] = (frontend.conductor.link.of(P.Submit)[-1], None)  # an answer awaited
    frontend.conductor.link.sent.clear()
    await frontend.conductor._resubmit()
    claims, resubmitted = frontend.conductor.link.sent
    assert isinstance(claims, P.Claims) and isinstance(resubmitted, P.Submit)
    assert [(c.submit.wire_id, c.route, c.prefilled) for c in claims.attempts] == \
        [(placed.wire_id, ROUTE, True), (waiting.wire_id, ROUTE, False)]


async def test_an_attempt_placed_with_no_conductor_is_reported_once_a_conductor_was_told_of_it(frontend):
    frontend.conductor.view = P.ClusterView("c0", FACTS, True, {"prefill": 1, "decode": 1},
                                            workers=[ROUTE.decode, *ROUTE.prefills])
    frontend.conductor.heard_at = -1e9  # no conductor heard from: the frontend places it itself
    req = await frontend.submit([1, 2, 3], P.Sampling(max_tokens=4))
    a = frontend.driver.attempts[req.wire_id]
    assert not a.route.planned and not a.booked
    frontend.driver.claims()  # told to a conductor that leads again
    start(frontend, req)
    frontend._on_tokens("d0", P.TokenEvent(req.wire_id, 1, [8, 9, 10], P.FinishReason.LENGTH))
    assert [p.wire_id for p in frontend.conductor.done_prefills] == [req.wire_id]
    assert req.wire_id in {e.wire_id for e in frontend.conductor.ended}  # the booking the conductor made goes


async def test_a_refused_request_takes_no_turn_from_its_tenant():
    """The fair order charges a request's prompt tokens to its tenant's clock when it arrives; a
    refusal gives them back, so a tenant refused at capacity does not lose its place to come."""
    import httpx

    from mooncake.api.routes import build_app
    from mooncake.frontend.tenant_clock import tenant_id

    cfg = Config()
    cfg.frontend.api_key = "sk-a"
    f = Frontend(cfg, tokenizer=None, model_name="m", node_id="f0")
    f.conductor.link = Link(f)
    f.conductor.view = P.ClusterView("c0", FACTS, True, {"prefill": 1, "decode": 1})
    f.conductor.link.refuse = P.Refused("", 429, "overloaded", "too many requests")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(f)), base_url="http://f") as client:
        r = await client.post("/v1/completions", headers={"Authorization": "Bearer sk-a"},
                              json={"model": "m", "prompt": list(range(1, 100)), "max_tokens": 4})
    assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text
    assert f.tenants.tag(tenant_id("sk-a"), 0) < time.time() + 0.5  # its 99 tokens would be ~1 s ahead
