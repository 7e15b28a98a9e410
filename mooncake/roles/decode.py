"""Decode role: reserve KV blocks, receive KV from prefill, decode in a continuous batch.

A request arrives from the frontend that drives its attempt as a ``DecodeRequest``:
decode reserves the blocks its KV needs (waiting, by request class, then in order, until
the pool has room) and answers ``Reserved``; only then does the frontend send the prefill,
whose KV lands straight in the reserved blocks. Memory on decode is therefore bounded by its
pool, never by what prefill pushes. Once all KV is in and the frontend has passed on the first
token (``FirstToken``), the sequence joins the continuous batch.

The reservations, the batch, its steps, preemption and retiring are ``DecodeBatch``'s
(``decode_batch.py``, shared with the colocated role); this role adds the KV that lands from prefill,
through the KV ingress (``mooncake/kv/ingress.py``; the batch is its ``DecodeSlots``): only the
attempt's, checked, straight into the reserved blocks, as whole blocks or one layer at a time.
"""

from __future__ import annotations

import asyncio

import torch

from mooncake import protocol as P
from mooncake.blocks import BlockHash
from mooncake.config import Config
from mooncake.engine import Sequence
from mooncake.kv.ingress import KVIngress, Slot
from mooncake.roles.decode_batch import DecodeBatch
from mooncake.roles.engine_host import EngineHost


class DecodeWorker:
    """The decode role (an ``EngineRole``): an ``EngineHost``, its ``DecodeBatch`` and KV ingress."""

    role = "decode"

    def __init__(self, cfg: Config) -> None:
        self.host = EngineHost(cfg, self.role)
        self.batch = DecodeBatch(self.host, self)  # this role is the batch's ``Admission``
        self.kv = KVIngress(self.batch, self.host.curve, self.host.rejections)

    async def start(self) -> None:
        host = self.host
        endpoint = self.kv.bind(host.ctx, host.cfg.node.host, host.cfg.node.kv_port, host.max_message_bytes)
        host.tasks += [asyncio.create_task(self.kv.receive_loop()),
                       asyncio.create_task(self.batch.run(self.batch.decode_step))]
        await host.serve(self, {"kv": endpoint})

    # ------------------------------------------------------------ EngineRole

    async def handle(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        await self.batch.handle(msg)

    def held_requests(self) -> list[str]:
        return self.batch.held_requests()

    def busy(self) -> bool:
        return self.batch.busy()

    def load(self) -> P.Load:
        # the engine has work: steps to run, or KV being written (KV still to come waits on prefill)
        load = self.host.load(pending=bool(self.batch.batch()) or self.kv.landing > 0)
        self.batch.report(load)
        load.progress += self.kv.writes  # landing KV is engine progress
        return load

    async def close(self) -> None:
        self.kv.close()
        self.batch.outlets.close()
        await self.host.close()

    # ------------------------------------------------------------ Admission

    def may_reserve(self, msg: P.DecodeRequest) -> bool:
        return True

    async def hold(self, msg: P.DecodeRequest) -> Sequence | None:
        """Blocks for ``msg``'s KV, which prefill will write in."""
        eng = self.host.engine
        return await self.host.run_engine(eng.reserve, msg.req_id, msg.tokens, [BlockHash(h) for h in msg.hashes],
                                          BlockHash(msg.root), msg.sampling, msg.num_generated)

    def ready(self, slot: Slot) -> bool:
        return slot.kv_complete

    async def begin(self, slot: Slot) -> None:
        await self.host.run_engine(self.host.engine.begin_decoding, slot.seq, slot.first_token)
