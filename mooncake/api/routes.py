"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health (api/health.py), /metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mooncake import protocol as P
from mooncake.api.errors import APIError, error_body, install_error_handlers
from mooncake.api.guard import Guard
from mooncake.api.health import add_health_routes
from mooncake.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from mooncake.api.text_stream import TextStream
from mooncake.roles.conductor import Conductor, RequestState


DISCONNECT_POLL_S = 0.5


def build_app(conductor: Conductor) -> FastAPI:
    app = FastAPI(title="mooncake", version="0.1.0")
    install_error_handlers(app)
    cfg = conductor.cfg.conductor

    app.add_middleware(Guard, api_key=cfg.api_key, limit=cfg.max_body_bytes)

    add_health_routes(app, conductor)

    @app.get("/cluster")
    async def cluster() -> dict:
        """Live nodes with their last reported load and the conductor's assignments."""
        return {"model": conductor.model_name, "index_blocks": len(conductor.index), "requests": len(conductor.requests),
                "estimates": {"prefill_1k_tokens_s": conductor.prefill_cost.predict(1000, 0),
                              "decode_step_batch_8_s": conductor.decode_cost.predict(8)},
                "nodes": [{"node_id": n.node_id, "role": n.role, "name": n.name, "endpoints": n.endpoints,
                           "load": n.load, "queued": len(n.work), "assigned": len(n.assigned),
                           "blocks_indexed": conductor.index.blocks_of(n.node_id)}
                          for n in conductor.cluster.nodes.values()]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(conductor.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": conductor.model_name, "object": "model", "created": 0,
                                            "owned_by": "mooncake", "max_model_len": conductor.max_model_len,
                                            "model_id": conductor.model_facts.get("model_id", "")}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check(conductor, body)
        prompt = body.prompt_input()
        tokens = list(prompt) if isinstance(prompt, list) else conductor.tokenizer.encode(prompt)
        return await _serve(conductor, request, body, tokens, chat=False, max_tokens=body.max_tokens or 16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check(conductor, body)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        text = conductor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tokens = conductor.tokenizer.encode(text, add_special_tokens=False)
        limit = body.limit() or max(1, conductor.max_model_len - len(tokens))
        return await _serve(conductor, request, body, tokens, chat=True, max_tokens=limit)

    return app


def _check(conductor: Conductor, body: _Sampling) -> None:
    body.check_supported()
    if body.model != conductor.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {conductor.model_name!r}",
                       param="model", code="model_not_found")


async def _serve(conductor: Conductor, request: Request, body: _Sampling, tokens: list[int], chat: bool,
                 max_tokens: int) -> Response:
    sampling = P.Sampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=max(0, body.top_k), seed=body.seed, ignore_eos=body.ignore_eos)
    limit = conductor.max_model_len
    if limit and len(tokens) + 1 > limit:
        raise APIError(400, f"the prompt has {len(tokens)} tokens; this model's context is {limit} tokens",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    req = conductor.submit(tokens, sampling, body.cache_salt or "")
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    pieces = _pieces(conductor, req, TextStream(conductor.tokenizer, body.stop or []))
    if body.stream:
        usage = body.stream_options.include_usage if body.stream_options else False
        return StreamingResponse(_sse(conductor, req, rid, chat, pieces, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text: list[str] = []
    reason = None

    async def collect() -> None:
        nonlocal reason
        async for piece, finish in pieces:
            text.append(piece)
            reason = finish or reason

    collector = asyncio.create_task(collect())
    try:
        while not collector.done():  # a client that goes away frees the request everywhere
            await asyncio.wait({collector}, timeout=DISCONNECT_POLL_S)
            if not collector.done() and await request.is_disconnected():
                collector.cancel()
                return Response(status_code=499)
        collector.result()
    finally:
        conductor.abort(req.req_id)
    if reason == "error":
        raise APIError(503, "".join(text) or "the request failed", code="worker_failed", retry_after_s=1)
    return JSONResponse(_response(conductor, req, rid, chat, "".join(text), reason or "stop"))


async def _pieces(conductor: Conductor, req: RequestState, stream: TextStream) -> AsyncIterator[tuple[str, str | None]]:
    """(text, finish_reason) pieces of a request's output; errors come as their message with "error"."""
    timeout = conductor.cfg.conductor.request_timeout_s
    while True:
        try:
            event = await asyncio.wait_for(req.events.get(), timeout)
        except asyncio.TimeoutError:
            conductor.abort(req.req_id)
            yield f"no progress for {timeout:.0f}s", "error"
            return
        if event[0] == "tokens":
            text = stream.push(event[1])
            if stream.stopped:
                conductor.abort(req.req_id)
                yield text, "stop"
                return
            if text:
                yield text, None
        else:
            _, reason, error = event
            if error or reason == "abort":  # ended by the server (e.g. shutting down), not finished
                yield error or "the request was cancelled by the server", "error"
            else:
                yield stream.flush(), "stop" if reason == "stop" else "length"
            return


def _usage(req: RequestState) -> dict:
    n_out = len(req.generated)
    return {"prompt_tokens": len(req.tokens), "completion_tokens": n_out, "total_tokens": len(req.tokens) + n_out,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}


def _response(conductor: Conductor, req: RequestState, rid: str, chat: bool, text: str, reason: str) -> dict:
    base = {"id": rid, "created": int(time.time()), "model": conductor.model_name, "usage": _usage(req)}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
        return {**base, "object": "chat.completion", "choices": [choice]}
    return {**base, "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": reason,
                                                              "logprobs": None}]}


async def _sse(conductor: Conductor, req: RequestState, rid: str, chat: bool,
               pieces: AsyncIterator[tuple[str, str | None]], include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> bytes:
        if chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice: dict = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        body = {"id": rid, "object": obj, "created": created, "model": conductor.model_name, "choices": [choice]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    try:
        if chat:
            yield chunk("", None, first=True)
        async for text, finish in pieces:
            if finish == "error":
                yield b"data: " + json.dumps(error_body(503, text, code="worker_failed")).encode() + b"\n\n"
                break
            if text or finish:
                yield chunk(text, finish)
        if include_usage:
            body = {"id": rid, "object": obj, "created": created, "model": conductor.model_name, "choices": [],
                    "usage": _usage(req)}
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:  # also runs when the client goes away: free the request everywhere
        conductor.abort(req.req_id)
