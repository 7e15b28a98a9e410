"""Stand-in prefill, decode and store instances that answer at once (no model).

One process holds several node identities, each with its own ``ConductorLink`` (the real
DEALER socket, registration handshake and heartbeats the real roles use) and ``Orders``
socket (where the frontends drive their attempts, as on the real roles), and registers them
with the bundled model's facts (computed from its config, no weights loaded), so that the
conductor's expected-model check, tokenizer and block hashing all work as in a real cluster.
Every order is answered at once with what a real worker would send its frontend:

* decode: ``DecodeRequest`` -> ``Reserved``; ``FirstToken`` -> the request joins the stand-in's
  batch, which steps every ``--step-ms`` (0: as fast as the loop turns): each step gives every
  request in it its next ``--tokens-per-event`` tokens (a real decode: 1), the last with
  ``finished = length``, and sends the step's events as the real decode does, to each request's
  frontend in one ``TokenStep`` (``--per-request-events``: one ``TokenEvent`` message each);
* prefill: ``PrefillRequest`` -> ``PrefillDone`` (cached tokens from its own device cache, the
  fetch plan's blocks as fetched), then device ``BlockEvent``s for the blocks it now caches
  (and ``removed`` for those its LRU pool evicts), and, when the request names a store, that
  store's for the blocks written to it, reported with the heartbeats as the real roles report them
  (``BlockEvents``);
* ``Abort``: the request is forgotten. Heartbeats report progress and no pending work.

    python benchmarks/standin_workers.py --config FILE [--prefill 4] [--decode 4] [--store 1]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import zmq.asyncio

from mooncake import protocol as P
from mooncake.config import Config, load_config
from mooncake.roles.block_events import BlockEvents
from mooncake.roles.conductor_link import ConductorLink
from mooncake.roles.orders import Orders
from mooncake.roles.token_outlets import TokenOutlets
from mooncake.roles.engine_host import machine_id

FIRST_OUTPUT_ID = 1000  # output token ids cycle from here: ordinary words, no special tokens


def bundled_facts(cfg: Config) -> tuple[P.ModelFacts, int, int]:
    """(facts, block bytes, KV blocks per instance) of the configured model in float32,
    as an engine loading it would register them (from the config, no weights)."""
    from transformers import AutoConfig

    from mooncake.conductor.expected_model import expected_model
    from mooncake.engine.loading.loader import resolve_model_dir

    exp = expected_model(cfg)
    hf = AutoConfig.from_pretrained(resolve_model_dir(cfg.model)[0])
    model_len = int(getattr(hf, "max_position_embeddings", 0) or 2048)
    max_len = min(cfg.engine.max_model_len, model_len) if cfg.engine.max_model_len else model_len
    facts = P.ModelFacts(f"{exp.weights_id}/float32{exp.variant}", exp.block_tokens, max_len, int(hf.vocab_size),
                         exp.block_shape, int(hf.hidden_size))
    block_bytes = math.prod(exp.block_shape) * 4
    return facts, block_bytes, cfg.engine.kv_cache_bytes // block_bytes


def token_events(req: P.DecodeRequest, per_event: int) -> list[P.TokenEvent]:
    """What a decode streams after the prefill's token: the request's generated tokens
    ``num_generated + 1`` up to ``max_tokens`` (which counts every attempt's tokens, as the
    conductor sends it), ``per_event`` a message, the last one finished by length."""
    start = req.num_generated + 1  # the prefill's token was number ``num_generated``
    end = req.sampling.max_tokens
    events = []
    for i in range(start, end, per_event):
        n = min(per_event, end - i)
        ids = [FIRST_OUTPUT_ID + i + k for k in range(n)]
        events.append(P.TokenEvent(req.req_id, i, ids, P.FinishReason.LENGTH if i + n == end else None))
    return events


def step(batch: dict[str, Iterator[P.TokenEvent]]) -> list[P.TokenEvent]:
    """One decode step: each request's next event; a request whose stream ends leaves ``batch``."""
    events = []
    for rid, stream in list(batch.items()):
        event = next(stream, None)
        if event is None or event.finished is not None:
            del batch[rid]
        if event is not None:
            events.append(event)
    return events


class LRUBlocks:
    """A device or store pool's cached block hashes, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def leading_hits(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, are cached (touching them)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Cache ``hashes``; returns (newly stored, evicted)."""
        stored = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return stored, evicted


class StandIn:
    """One node identity and its link to the conductor."""

    def __init__(self, ctx: zmq.asyncio.Context, cfg: Config, role: str, index: int, facts: P.ModelFacts | None,
                 num_blocks: int, block_bytes: int, endpoints: dict[str, str], cluster: "StandInCluster") -> None:
        self.role, self.node_id, self.cluster = role, f"node{index}-{role}", cluster
        self.cache = LRUBlocks(num_blocks)
        self.progress = 0
        self.decoding: dict[str, P.DecodeRequest] = {}  # reserved, waiting for the first token
        self.batch: dict[str, Iterator[P.TokenEvent]] = {}  # decoding: each request's events to come
        self._stepping: asyncio.Task | None = None
        self.reply_to: dict[str, str] = {}  # decoding request -> its frontend's token endpoint
        self.outlets = TokenOutlets(ctx, self.node_id, None)
        self.events = BlockEvents(self.node_id)  # reported as the real roles report them
        self.orders = Orders(ctx, "127.0.0.1", None, 64 << 20, self.node_id, lambda msg, _: self.handle(msg)) \
            if role != "store" else None
        if self.orders is not None:
            endpoints = {**endpoints, "orders": self.orders.endpoint}
        info = P.NodeInfo(f"node{index}", os.getpid(), facts, num_blocks if facts else 0,
                          block_bytes if facts else 0, None, cpus=1, threads=1, machine=machine_id(),
                          instance=P.process_instance())
        self.link = ConductorLink(ctx, cfg.conductor.endpoint, P.Register(role, self.node_id, info, endpoints),
                                  self.load)

    def load(self) -> P.Load:
        return P.Load(free_blocks=self.cache.capacity - len(self.cache.blocks), used_blocks=0,
                      sequences=len(self.decoding) + len(self.batch), progress=self.progress, pending=False)

    async def serve(self) -> None:
        await self.link.connect(timeout_s=60)
        self.link.start_heartbeat(self.events)
        if self.orders is not None:
            self.cluster.tasks.append(asyncio.create_task(self.orders.serve(lambda: [*self.decoding, *self.batch])))
        while True:
            msg, _ = await self.link.recv()
            await self.handle(msg)

    async def send(self, msg: P.Msg) -> None:
        """To the frontend that ordered the attempt, or to the conductor."""
        if self.orders is None or not await self.orders.reply(msg):
            await self.link.send(msg)

    async def handle(self, msg: P.Msg) -> None:
        send = self.send
        self.progress += 1
        if isinstance(msg, P.DecodeRequest):
            self.decoding[msg.req_id] = msg
            await send(P.Reserved(msg.req_id, self.node_id))
        elif isinstance(msg, P.FirstToken):
            req = self.decoding.pop(msg.req_id, None)
            if req is not None:
                self.reply_to[req.req_id] = req.reply_to
                self.batch[req.req_id] = iter(token_events(req, self.cluster.tokens_per_event))
                if self._stepping is None or self._stepping.done():
                    self._stepping = asyncio.create_task(self.step_loop())
        elif isinstance(msg, P.PrefillRequest):
            await self.prefill(msg)
        elif isinstance(msg, P.Abort):
            self.decoding.pop(msg.req_id, None)
            self.batch.pop(msg.req_id, None)
            self.reply_to.pop(msg.req_id, None)

    async def step_loop(self) -> None:
        """Decode steps while the batch has requests: each its next event, sent per step to the
        request's frontend (``reply_to``), as the real decode does."""
        while self.batch:
            by_frontend: dict[str, list[P.TokenEvent]] = {}
            for event in step(self.batch):
                by_frontend.setdefault(self.reply_to.get(event.req_id, ""), []).append(event)
                if event.finished is not None:
                    self.reply_to.pop(event.req_id, None)
            for endpoint, events in by_frontend.items():
                batches = [[e] for e in events] if self.cluster.per_request_events else [events]
                for batch in batches:
                    if endpoint:
                        await self.outlets.send(endpoint, batch)
                    else:
                        await self.link.send(batch[0] if len(batch) == 1 else P.TokenStep(batch))
            await asyncio.sleep(self.cluster.step_s)

    async def prefill(self, req: P.PrefillRequest) -> None:
        bt = self.cluster.facts.block_tokens
        cached = self.cache.leading_hits(req.hashes)
        fetched = sum(f.end - f.start for f in req.fetch)
        reused = max(cached, max((f.end for f in req.fetch), default=0))
        done = None if req.sampling.max_tokens - req.num_generated > 1 else P.FinishReason.LENGTH
        await self.send(P.PrefillDone(req.req_id, self.node_id, FIRST_OUTPUT_ID + req.num_generated,
                                           cached * bt, len(req.tokens) - reused * bt, 0.001, fetched, 0.0, done))
        stored, evicted = self.cache.insert(req.hashes)
        self.events.add("removed", "device", evicted)
        self.events.add("stored", "device", stored)
        store = self.cluster.stores.get(req.store_endpoint)
        if store is not None:
            await store.put(req.hashes[reused:])

    async def put(self, hashes: list[bytes]) -> None:
        """A store: blocks written to it, announced as the real store does."""
        stored, evicted = self.cache.insert(hashes)
        self.events.add("removed", "dram", evicted)
        self.events.add("stored", "dram", stored)


class StandInCluster:
    def __init__(self, cfg: Config, prefill: int, decode: int, store: int, tokens_per_event: int = 1,
                 step_s: float = 0.0, per_request_events: bool = False) -> None:
        self.facts, block_bytes, num_blocks = bundled_facts(cfg)
        self.tokens_per_event, self.step_s, self.per_request_events = tokens_per_event, step_s, per_request_events
        self.ctx = zmq.asyncio.Context()
        self.nodes: list[StandIn] = []
        self.tasks: list[asyncio.Task] = []  # the orders sockets' loops
        self.stores: dict[str, StandIn] = {}
        store_blocks = cfg.store.dram_bytes // block_bytes
        for i in range(store):
            endpoint = f"tcp://127.0.0.1:{20000 + i}"  # advertised, never connected to: puts are in-process
            node = StandIn(self.ctx, cfg, "store", i, None, store_blocks, block_bytes, {"store": endpoint}, self)
            self.stores[endpoint] = node
            self.nodes.append(node)
        for i in range(prefill):
            self.nodes.append(StandIn(self.ctx, cfg, "prefill", i, self.facts, num_blocks, block_bytes, {}, self))
        for i in range(decode):
            self.nodes.append(StandIn(self.ctx, cfg, "decode", i, self.facts, num_blocks, block_bytes,
                                      {"kv": f"tcp://127.0.0.1:{21000 + i}"}, self))

    async def run(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(n.serve()) for n in self.nodes]
        waiter = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in tasks + self.tasks + [n._stepping for n in self.nodes if n._stepping is not None]:
            t.cancel()
        for n in self.nodes:
            n.link.close()
            n.outlets.close()
            if n.orders is not None:
                n.orders.close()
        self.ctx.term()
        for t in done:
            if t is not waiter and t.exception() is not None:
                raise t.exception()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--store", type=int, default=1)
    ap.add_argument("--tokens-per-event", type=int, default=1, help="tokens per TokenEvent (a real decode: 1)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="a decode step's time (0: the loop's turn)")
    ap.add_argument("--per-request-events", action="store_true",
                    help="one message per request per step (the decode before TokenStep)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    asyncio.run(StandInCluster(cfg, args.prefill, args.decode, args.store, args.tokens_per_event,
                               args.step_ms / 1000, args.per_request_events).run())


if __name__ == "__main__":
    main()
