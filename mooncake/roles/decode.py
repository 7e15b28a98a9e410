"""Decode role: receive KV from prefill, decode in a continuous batch, stream tokens.

KV arrives on a PULL socket as a run of ``KVTransfer`` messages per request
(full blocks while prefill still computes, then a final one with the tail).
Complete requests join the batch between steps; each step yields one token per
sequence, sent to the conductor. A finished sequence's new full blocks (those
holding generated tokens) are written to the store so the next turn hits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import torch
import zmq

from mooncake import protocol as P
from mooncake.engine import Sequence
from mooncake.roles.worker import EngineWorker

log = logging.getLogger(__name__)
PARTIAL_TTL_S = 120.0  # KV of a request whose final part never comes is dropped after this


class DecodeWorker(EngineWorker):
    role = "decode"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.partial: dict[str, tuple[float, list[torch.Tensor]]] = {}
        self.ready: deque[tuple[P.KVTransfer, torch.Tensor]] = deque()
        self.running: dict[str, Sequence] = {}
        self.meta: dict[str, P.KVTransfer] = {}  # final transfer message per running request
        self.aborted: dict[str, float] = {}
        self.steps: list[tuple[int, float]] = []  # (batch, seconds) since the last heartbeat
        self._wake = asyncio.Event()

    async def start(self) -> None:
        self.kv_sock = self.ctx.socket(zmq.PULL)
        self.kv_sock.setsockopt(zmq.LINGER, 0)
        port = self.cfg.node.kv_port
        self.kv_sock.bind(f"tcp://{self.cfg.node.host}:{port}" if port else f"tcp://{self.cfg.node.host}:*")
        endpoint = self.kv_sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._tasks += [asyncio.create_task(self._kv_loop()), asyncio.create_task(self._step_loop())]
        await self.serve({"kv": endpoint})

    def busy(self) -> bool:
        return bool(self.running or self.ready or self.partial)

    def load(self) -> dict[str, Any]:
        steps, self.steps = self.steps, []
        return {**super().load(), "running": len(self.running), "waiting": len(self.ready), "steps": steps[-32:]}

    async def handle(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        if isinstance(msg, P.Abort):
            self.aborted[msg.req_id] = time.monotonic()
            self.partial.pop(msg.req_id, None)
            self._wake.set()
        else:
            log.warning("decode ignores %s", type(msg).__name__)

    async def _kv_loop(self) -> None:
        while True:
            frames = await self.kv_sock.recv_multipart(copy=False)
            try:
                msg, tensors = P.decode(frames)
                if not isinstance(msg, P.KVTransfer):
                    raise P.ProtocolError(f"expected KV, got {type(msg).__name__}")
            except P.ProtocolError as e:
                log.warning("dropping malformed KV message: %s", e)
                continue
            if msg.req_id in self.aborted:
                continue
            now = time.monotonic()
            blocks = self.partial.setdefault(msg.req_id, (now, []))[1]
            if msg.first_block != len(blocks):
                log.warning("KV of %s out of order (block %d, have %d): dropped", msg.req_id, msg.first_block,
                            len(blocks))
                self.partial.pop(msg.req_id, None)
                continue
            blocks.extend(tensors)
            if msg.final:
                self.partial.pop(msg.req_id, None)
                self.ready.append((msg, torch.stack(blocks)))
                self._wake.set()
            self._expire(now)

    def _expire(self, now: float) -> None:
        for rid, (t, _) in list(self.partial.items()):
            if now - t > PARTIAL_TTL_S:
                del self.partial[rid]
        for rid, t in list(self.aborted.items()):
            if now - t > PARTIAL_TTL_S:
                del self.aborted[rid]

    async def _admit(self) -> None:
        eng = self.engine
        while self.ready and len(self.running) < self.cfg.engine.max_batch:
            msg, kv = self.ready[0]
            if msg.req_id in self.aborted:
                self.ready.popleft()
                continue
            assert msg.sampling is not None
            seq = await self.run_engine(eng.add_decoding, msg.req_id, msg.tokens, kv, msg.next_token,
                                        msg.sampling, msg.num_generated, msg.cache_salt or None)
            if seq is None:
                if not self.running:  # nothing will free memory: this request can never fit here
                    self.ready.popleft()
                    await self._send_tokens(msg.req_id, [], "error", "KV does not fit in the decode pool")
                break  # wait for running sequences to finish
            self.ready.popleft()
            self.running[msg.req_id] = seq
            self.meta[msg.req_id] = msg

    async def _step_loop(self) -> None:
        while True:
            for rid in [r for r in self.running if r in self.aborted]:
                await self._retire(rid, write=False)
            await self._admit()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = list(self.running.values())
            t0 = time.perf_counter()
            outs = await self.run_engine(self.engine.decode_step, seqs)
            self.steps.append((len(seqs), time.perf_counter() - t0))
            for out in outs:
                rid = out.seq.req_id
                if rid in self.aborted or rid not in self.running:
                    continue
                if out.token is None and not out.finished:
                    continue  # no block this step; retried next step
                await self._send_tokens(rid, [] if out.token is None else [int(out.token)], out.finished)
                if out.finished:
                    await self._retire(rid, write=True)

    async def _send_tokens(self, req_id: str, tokens: list[int], finished: str, error: str = "") -> None:
        assert self.link is not None
        await self.link.send(P.TokenEvent(req_id, tokens, finished, error))

    async def _retire(self, req_id: str, write: bool) -> None:
        seq = self.running.pop(req_id)
        msg = self.meta.pop(req_id)
        first_new = len(msg.tokens) // self.engine.block_tokens
        hashes = list(seq.block_hashes)
        if write and msg.store_endpoint and len(hashes) > first_new:
            kv = await self.run_engine(self.engine.export_sequence, seq, first_new, len(hashes))
            self.write_back(msg.store_endpoint, hashes[first_new:], kv)
        await self.run_engine(self.engine.free, seq)

    async def close(self) -> None:
        self.kv_sock.close(0)
        await super().close()
