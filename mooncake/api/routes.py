"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health (api/health.py), /metrics,
/cluster.

A completion route is parse -> submit -> format: the body is validated, turned
into token ids (off the event loop), submitted to the conductor (a refusal
becomes its HTTP error), and the request's events are formatted as one JSON
response or as SSE. Whatever way a response ends — finished, failed, client
gone — ``_outputs`` cancels the request, the one place that does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

import msgspec
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mooncake import protocol as P
from mooncake.api.errors import APIError, install_error_handlers
from mooncake.api.guard import Guard, request_salt
from mooncake.api.prompts import Prompts
from mooncake.api.health import add_health_routes
from mooncake.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from mooncake.api.sse import Piece, sse_stream
from mooncake.api.text_stream import TextStream
from mooncake.conductor import Conductor, Finished, Rejection, Request, RequestError, Tokens

DISCONNECT_POLL_S = 0.5


def build_app(conductor: Conductor) -> FastAPI:
    app = FastAPI(title="mooncake", version="0.1.0")
    install_error_handlers(app)
    cfg = conductor.cfg.conductor
    app.add_middleware(Guard, api_keys=cfg.accepted_keys(), limit=cfg.max_body_bytes)
    prompts = Prompts(conductor.tokenizer)

    add_health_routes(app, conductor)

    @app.get("/cluster")
    async def cluster() -> dict:
        """Nodes with their socket endpoints, last reported load and the scheduler's bookings."""
        s = conductor.scheduler
        costs = conductor.costs
        pw, dw = costs.prefill.weights, costs.decode.weights
        facts = conductor.facts
        return {"model": conductor.model_name, "index_blocks": len(conductor.index), "requests": len(conductor.requests),
                "block_tokens": facts.block_tokens if facts else 0,
                "estimates": {"prefill_1k_tokens_s": costs.prefill.predict(1000, 0),
                              "decode_step_batch_8_s": costs.decode.predict(8),
                              "prefill_fixed_s": pw[0], "prefill_per_token_s": pw[1] / 1000,
                              "prefill_per_pair_s": pw[2] / 1e6, "decode_step_s": dw[0], "decode_per_seq_s": dw[1],
                              "fetch_block_s": costs.prefill.fetch_block_s,
                              "dispatch_s": costs.prefill.dispatch.value, "transit_s": costs.prefill.transit.value,
                              "profiled": sorted(costs.profiled)},
                "predictions": conductor.predictions.summary(),
                "nodes": [{"node_id": n.node_id, "role": n.role, "name": n.name, "pid": n.info.pid,
                           "endpoints": n.endpoints,
                           "num_blocks": n.info.num_blocks, "block_bytes": n.info.block_bytes,
                           "load": msgspec.to_builtins(n.load), "queued": s.queued(n.node_id),
                           "assigned": s.assigned(n.node_id), "draining": n.draining, "stalled": n.stalled,
                           "blocks_indexed": conductor.index.blocks_of(n.node_id)}
                          for n in conductor.cluster.nodes.values()]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(conductor.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        facts = conductor.facts
        return {"object": "list", "data": [{"id": conductor.model_name, "object": "model", "created": 0,
                                            "owned_by": "mooncake", "max_model_len": conductor.max_model_len,
                                            "model_id": facts.model_id if facts else ""}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        _check(conductor, body)
        tokens = await prompts.completion(body.prompt_input())
        return await _serve(conductor, request, body, tokens, chat=False, max_tokens=body.max_tokens or 16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        _check(conductor, body)
        tokens = await prompts.chat(body.messages)
        limit = body.limit() or max(1, conductor.max_model_len - len(tokens))
        return await _serve(conductor, request, body, tokens, chat=True, max_tokens=limit)

    return app


def _check(conductor: Conductor, body: _Sampling) -> None:
    body.check_supported()
    if body.model != conductor.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {conductor.model_name!r}",
                       param="model", code="model_not_found")


def _error(e: Rejection | RequestError, chat: bool) -> APIError:
    param = "messages" if chat and e.param == "prompt" else e.param
    if isinstance(e, Rejection):
        return APIError(e.status, e.message, param, e.reason, e.retry_after_s)
    return APIError(e.status, e.message, param, e.code, 1 if e.status >= 500 else None)


async def _serve(conductor: Conductor, http: HTTPRequest, body: _Sampling, tokens: list[int], chat: bool,
                 max_tokens: int) -> Response:
    sampling = P.Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(0, body.top_k), seed=body.seed, ignore_eos=body.ignore_eos)
    salt = request_salt(conductor.cfg.conductor.salt_per_api_key, http.scope, body.cache_salt or "")
    submitted = conductor.submit(tokens, sampling, salt)
    if isinstance(submitted, Rejection):
        raise _error(submitted, chat)
    req = submitted
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    pieces = _outputs(conductor, req, TextStream(conductor.tokenizer, body.stop or []))
    if body.stream:
        usage = body.stream_options.include_usage if body.stream_options else False
        sse = sse_stream(pieces, rid, conductor.model_name, chat, lambda: _usage(req) if usage else None,
                         lambda e: _error(e, chat).body())
        return StreamingResponse(sse, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text: list[str] = []
    last: list[Piece] = []

    async def collect() -> None:
        async for piece in pieces:
            text.append(piece.text)
            last[:] = [piece]

    collector = asyncio.create_task(collect())
    while not collector.done():  # a client that goes away frees the request everywhere
        await asyncio.wait({collector}, timeout=DISCONNECT_POLL_S)
        if not collector.done() and await http.is_disconnected():
            collector.cancel()
            return Response(status_code=499)
    collector.result()
    end = last[0] if last else Piece("", "stop")
    if end.error is not None:
        raise _error(end.error, chat)
    return JSONResponse(_response(conductor, req, rid, chat, "".join(text), end.finish or "stop"))


async def _outputs(conductor: Conductor, req: Request, stream: TextStream) -> AsyncIterator[Piece]:
    """The request's output as text pieces; the last one has a finish reason or an error.
    Ends the request everywhere however the consumer stops (the single cancel path)."""
    try:
        while True:
            event = await req.events.get()
            if isinstance(event, Tokens):
                text = stream.push(event.ids)
                if stream.stopped:
                    yield Piece(text, "stop")
                    return
                if text:
                    yield Piece(text)
                continue
            assert isinstance(event, Finished)
            if event.reason in (P.FinishReason.STOP, P.FinishReason.LENGTH):
                yield Piece(stream.flush(), event.reason.value)
            else:  # ended by the server (shutting down) or failed
                yield Piece("", None, event.error or RequestError("the request was cancelled by the server"))
            return
    finally:
        conductor.cancel(req.req_id)


def _usage(req: Request) -> dict:
    n_out = len(req.generated)
    return {"prompt_tokens": len(req.tokens), "completion_tokens": n_out, "total_tokens": len(req.tokens) + n_out,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def _response(conductor: Conductor, req: Request, rid: str, chat: bool, text: str, reason: str) -> dict:
    base = {"id": rid, "created": int(time.time()), "model": conductor.model_name, "usage": _usage(req)}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
        return {**base, "object": "chat.completion", "choices": [choice]}
    return {**base, "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": reason,
                                                              "logprobs": None}]}
