"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health (api/health.py), /metrics,
/cluster.

A completion route is parse -> submit -> format: the body is validated, turned
into token ids (off the event loop), submitted to the conductor by the frontend (a refusal
becomes its HTTP error), and the request's events are formatted as one JSON
response or as SSE. Whatever way a response ends — finished, failed, client
gone — ``_outputs`` cancels the request, the one place that does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from mooncake import protocol as P
from mooncake.api.errors import APIError, install_error_handlers
from mooncake.api.guard import Guard, request_salt
from mooncake.api.prompts import Prompts
from mooncake.api.request_id import RequestId
from mooncake.api.trace_requests import trace_requests
from mooncake.api.health import add_health_routes
from mooncake.api.choices import ChoiceOutput, TokenText, chat_logprobs, completion_logprobs, merged
from mooncake.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling, check_response_size
from mooncake.api.sse import Piece, SSEResponse, StreamFormat, sse_stream
from mooncake.api.structured import compile_grammar, tool_calls, tools_for_template
from mooncake.api.tokens import add_token_routes
from mooncake.api.text_stream import TextStream
from mooncake.frontend import Finished, Frontend, Rejection, Request, RequestError, Tokens
from mooncake.frontend.tenant_clock import tenant_id
from mooncake.sched.admission import context_rejection
from mooncake.sched.request_class import served_class
from mooncake.tracing import span

DISCONNECT_POLL_S = 0.5


def build_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="mooncake", version="0.1.0")
    install_error_handlers(app)
    cfg = frontend.cfg.frontend
    app.add_middleware(Guard, api_keys=cfg.accepted_keys(), limit=cfg.max_body_bytes)
    app.add_middleware(RequestId, log_access=cfg.access_log, recent=frontend.stats.recent)
    app.add_middleware(trace_requests, tracer=frontend.stats.tracer)
    prompts = Prompts(frontend.tokenizer, frontend.codec)

    add_health_routes(app, frontend)

    @app.get("/cluster")
    async def cluster() -> dict:
        """The leader, the frontends, the nodes with their endpoints, last reported load and the
        scheduler's bookings (the conductor's snapshot, asked now)."""
        if frontend.conductor.leaderless:  # answered at once: nobody would answer the question
            raise APIError(503, "no conductor leads: this frontend places requests over the workers it last knew",
                           code="no_conductor")
        try:
            return await frontend.cluster_snapshot()
        except asyncio.TimeoutError:
            raise APIError(503, "the conductor did not answer", code="no_conductor") from None

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        facts = frontend.facts
        return {"object": "list", "data": [{"id": frontend.model_name, "object": "model", "created": 0,
                                            "owned_by": "mooncake", "max_model_len": frontend.max_model_len,
                                            "model_id": facts.model_id if facts else ""}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        _check(frontend, body)
        prompt = body.prompt_input()
        with span(frontend.stats.tracer, "frontend.tokenize"):
            tokens = await prompts.completion(prompt)
        too_long = context_rejection(len(tokens), frontend.max_model_len)
        if too_long is not None:  # before the echo's decoding: refused at the cost of its length
            raise _error(too_long, chat=False)
        echo = (prompt if isinstance(prompt, str) else await prompts.decode(tokens)) if body.echo else ""
        return await _serve(frontend, request, body, tokens, Shape(chat=False, echo=echo),
                            max_tokens=body.max_tokens or 16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        _check(frontend, body)
        with span(frontend.stats.tracer, "frontend.template_tokenize", attrs={"mooncake.messages": len(body.messages)}):
            tokens = await prompts.chat(body.messages, tools_for_template(body))
        limit = body.limit() or max(1, frontend.max_model_len - len(tokens))
        shape = Shape(chat=True, grammar=await compile_grammar(body, frontend.cfg.frontend), tool_mode=body.tool_mode(), body=body)
        return await _serve(frontend, request, body, tokens, shape, max_tokens=limit)

    @app.get("/v1/requests/{request_id}")
    async def request_timeline(request_id: str) -> dict:
        """Where a request finished here in the last few minutes spent its time (``frontend/timeline.py``),
        by its id or the X-Request-Id it was sent with."""
        kept = frontend.stats.recent.get(request_id)
        if kept is None:
            raise APIError(404, f"no request {request_id!r} finished on this frontend in the last few minutes",
                           param="request_id", code="request_not_found")
        return {"object": "request.timeline", **kept}

    add_token_routes(app, frontend, prompts)
    return app


def _check(frontend: Frontend, body: _Sampling) -> None:
    body.check_supported()
    if body.model != frontend.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {frontend.model_name!r}",
                       param="model", code="model_not_found")


def _error(e: Rejection | RequestError, chat: bool) -> APIError:
    param = "messages" if chat and e.param == "prompt" else e.param
    if isinstance(e, Rejection):
        return APIError(e.status, e.message, param, e.reason, e.retry_after_s)
    return APIError(e.status, e.message, param, e.code, 1 if e.status >= 500 else None)


@dataclass
class Shape:
    """What a route makes of its choices' outputs."""

    chat: bool
    echo: str = ""  # completions: the prompt text before each choice's
    grammar: str = ""  # chat: the output's grammar (response_format, tools)
    tool_mode: str = "none"  # chat: none | auto | required | named
    body: ChatCompletionRequest | None = None

    def tools(self, text: str) -> tuple[str | None, list[dict]]:
        assert self.body is not None
        return tool_calls(self.tool_mode, text, self.body)


def _sampling(body: _Sampling, max_tokens: int, grammar: str, seed: int | None, classing: dict) -> P.Sampling:
    """``classing``: the request's class, priority, fair tag and session keep (``_classing``)."""
    return P.Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
                      seed=seed, ignore_eos=body.ignore_eos, stop_token_ids=list(body.stop_token_ids or []),
                      min_tokens=body.min_tokens, min_p=body.min_p, presence_penalty=body.presence_penalty,
                      frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                      logit_bias=dict(body.logit_bias or {}), logprobs=body.logprobs_wanted(), grammar=grammar,
                      speculative=body.speculative, **classing)


def _classing(frontend: Frontend, http: HTTPRequest, body: _Sampling, n_tokens: int) -> dict:
    """Where the request is served among others: its class, within the ceiling of its API key's
    class, its priority no more urgent than the key allows, its place in the fair order among keys
    (no keys: every class and priority open, one tenant), and whether its prefix is kept."""
    classes = frontend.cfg.classes
    api_key = http.scope.get("state", {}).get("api_key", "")
    terms, tenant = (classes.terms_of_key(api_key) if api_key else None), tenant_id(api_key)
    request_class = served_class(body.service_tier, terms.request_class if terms else None)
    # a session's prefix is kept for its next turn (by user where the operator says so; flex work's only by session_id)
    session = body.session_id or (classes.session_from_user and body.user and request_class != "flex")
    return {"request_class": request_class, "priority": max(body.priority, terms.min_priority) if terms else body.priority,
            "fair_tag": frontend.tenants.tag(tenant, n_tokens, terms.weight if terms else 1.0),
            "keep_s": classes.session_ttl_s if session else 0.0, "tenant": tenant}


async def _serve(frontend: Frontend, http: HTTPRequest, body: _Sampling, tokens: list[int], shape: Shape,
                 max_tokens: int) -> Response:
    chat = shape.chat
    room = frontend.max_model_len - len(tokens) if frontend.max_model_len else max_tokens
    check_response_size(body, max(1, min(max_tokens, room)))  # the conductor clamps to what the context leaves
    classing = _classing(frontend, http, body, len(tokens))
    sampling = _sampling(body, max_tokens, shape.grammar, body.seed, classing)
    salt = request_salt(frontend.cfg.frontend.salts_per_key(), http.scope, body.cache_salt or "")
    submitted = await frontend.submit(tokens, sampling, salt, request_id=getattr(http.state, "request_id", ""),
                                      choices=body.n)
    if isinstance(submitted, Rejection):
        frontend.tenants.refund(sampling.tenant, len(tokens))  # a refused request takes no turn from its tenant
        raise _error(submitted, chat)
    http.scope.setdefault("state", {})["mooncake_request"] = submitted  # its timeline: the access log's, its trace's
    # the other choices share the prompt's KV: they start once the first one's prefill is done
    reqs = [submitted] + [frontend.fork(submitted, _sampling(body, submitted.sampling.max_tokens, shape.grammar,
                                                               None if body.seed is None else (body.seed + i) % 2**64,
                                                               classing))
                          for i in range(1, body.n)]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    streams = [_outputs(frontend, r, TextStream(frontend.codec, body.stop or [])) for r in reqs]
    events = merged(streams, frontend.cfg.frontend.sse_keepalive_s if body.stream else 3600.0)
    text_of = TokenText(frontend.codec)
    if body.stream:
        usage = body.stream_options.include_usage if body.stream_options else False
        fmt = StreamFormat(n=body.n, echo=shape.echo, calls_finish=shape.tool_mode != "named", request_class=sampling.request_class,
                           tools=shape.tools if chat and shape.tool_mode != "none" else None,
                           logprobs=None if body.logprobs_wanted() < 0 else (
                               (lambda p, off: chat_logprobs(list(p.logprobs), text_of)) if chat else
                               (lambda p, off: completion_logprobs(list(p.logprobs), text_of, off))))
        sse = sse_stream(events, rid, frontend.model_name, chat, lambda: _usage(reqs) if usage else None,
                         lambda e: _error(e, chat).body(), fmt)
        return SSEResponse(sse, frontend.cfg.frontend.sse_write_timeout_s)
    outs = [ChoiceOutput() for _ in reqs]
    failure: list[RequestError] = []

    async def collect() -> None:
        async for piece in events:
            if piece is None:
                continue
            if piece.error is not None:
                failure.append(piece.error)
                return
            outs[piece.index].add(piece)

    collector = asyncio.create_task(collect())
    try:
        while not collector.done():  # a client that goes away frees the requests everywhere
            await asyncio.wait({collector}, timeout=DISCONNECT_POLL_S)
            if not collector.done() and await http.is_disconnected():
                collector.cancel()
                await asyncio.gather(collector, return_exceptions=True)
                return Response(status_code=499)
        collector.result()
    finally:
        await events.aclose()
    if failure:
        raise _error(failure[0], chat)
    return JSONResponse(_response(frontend, reqs, rid, shape, outs, body.logprobs_wanted() >= 0, text_of))


async def _outputs(frontend: Frontend, req: Request, stream: TextStream) -> AsyncIterator[Piece]:
    """The request's output as text pieces; the last one has a finish reason or an error.
    Ends the request everywhere however the consumer stops (the single cancel path)."""
    try:
        while True:
            event = await req.events.get()
            if isinstance(event, Tokens):
                text = stream.push(event.ids)
                lps = tuple(zip(event.ids, event.logprobs)) if event.logprobs else ()
                if stream.stopped:
                    yield Piece(text, "stop", logprobs=lps)
                    return
                if text or lps:
                    yield Piece(text, logprobs=lps)
                continue
            assert isinstance(event, Finished)
            if event.reason in (P.FinishReason.STOP, P.FinishReason.LENGTH):
                yield Piece(stream.flush(), event.reason.value)
            else:  # ended by the server (shutting down) or failed
                yield Piece("", None, event.error or RequestError("the request was cancelled by the server"))
            return
    finally:
        frontend.cancel(req.req_id)


def _usage(reqs: list[Request]) -> dict:
    prompt = len(reqs[0].tokens)
    n_out = sum(len(r.generated) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": n_out, "total_tokens": prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens}}


def _response(frontend: Frontend, reqs: list[Request], rid: str, shape: Shape, outs: list[ChoiceOutput],
              logprobs: bool, text_of: TokenText) -> dict:
    base = {"id": rid, "created": int(time.time()), "model": frontend.model_name, "usage": _usage(reqs),
            "service_tier": reqs[0].sampling.request_class}
    choices = []
    for i, out in enumerate(outs):
        text, reason = "".join(out.text), out.finish or "stop"
        if shape.chat:
            message: dict = {"role": "assistant", "content": text}
            if shape.tool_mode != "none":
                content, calls = shape.tools(text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" and shape.tool_mode != "named" else reason
            lp = chat_logprobs(out.logprobs, text_of) if logprobs else None
            choices.append({"index": i, "message": message, "finish_reason": reason, "logprobs": lp})
        else:
            lp = completion_logprobs(out.logprobs, text_of, len(shape.echo)) if logprobs else None
            choices.append({"index": i, "text": shape.echo + text, "finish_reason": reason, "logprobs": lp})
    if shape.chat:
        return {**base, "object": "chat.completion", "choices": choices}
    return {**base, "object": "text_completion", "choices": choices}
