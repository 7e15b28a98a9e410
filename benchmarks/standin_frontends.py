"""Stand-in frontends: the conductor's load without HTTP, tokenizer or detokenizer (issue 29).

Each stand-in registers with the conductor as a real frontend does (``ConductorLink``, role
``frontend``, a token socket the decodes stream to) and keeps ``--concurrency`` requests in
flight, closed loop: ``Submit`` (prompt tokens and block hashes, computed once up front: half of
the prompts open with one of 8 shared prefixes) -> ``Admitted`` -> the attempt driven along its
route by the real ``AttemptDriver`` (its prefill reported in the next ``Release`` batch) -> the
decode's tokens on its token socket until the last -> the attempt in the next ``Release`` batch
-> the next request. Its conversation with the conductor is a real frontend's
(``ConductorClient``: batches, heartbeats and all), so the conductor under it does all the work it
would do behind real frontends. Prints one JSON line
when done: completed requests, seconds, and refusals.

    python benchmarks/standin_frontends.py --config FILE [--frontends 1] [--concurrency 64] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.blocks import hash_blocks, root_hash
from mooncake.config import load_config
from mooncake.frontend.attempt_driver import AttemptDriver, DrivenAttempt
from mooncake.frontend.conductor_client import ConductorClient
from mooncake.sockets import recv_multipart

from standin_workers import bundled_facts


def prompt_pool(facts: P.ModelFacts, n: int, seed: int = 0) -> list[tuple[list[int], list[bytes]]]:
    """(tokens, hashes) of ``n`` prompts of 200-2,000 tokens; half open with one of 8 shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(128, 1024))] for _ in range(8)]
    pool = []
    for i in range(n):
        length = rng.randrange(200, 2000)
        head = prefixes[i % 8][:length] if i % 2 else []
        tokens = head + [rng.randrange(1000, 20000) for _ in range(length - len(head))]
        pool.append((tokens, hash_blocks(tokens, facts.block_tokens, facts.model_id)))
    return pool


class StandInFrontend:
    def __init__(self, ctx: zmq.asyncio.Context, cfg, index: int, facts: P.ModelFacts, pool: list,
                 max_tokens: int) -> None:
        self.node_id, self.facts, self.pool, self.max_tokens = f"bench-frontend-{index}", facts, pool, max_tokens
        self.tokens = ctx.socket(zmq.ROUTER)
        self.tokens.bind("tcp://127.0.0.1:0")
        endpoint = self.tokens.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.ctx = ctx
        self.reg = P.Register("frontend", self.node_id, P.NodeInfo(f"bench{index}", os.getpid(),
                                                                  instance=P.process_instance()), {"tokens": endpoint})
        self.conductor = ConductorClient(cfg, self.node_id, lambda msg: None)
        self.root = root_hash(facts.model_id)
        self.waiting: dict[str, asyncio.Future] = {}  # wire id -> set when its last token came
        self.driver = AttemptDriver(ctx, None, self.node_id, endpoint, 64 << 20, self._on_prefilled,
                                    lambda a, failed: self._finish(a.wire_id))
        self.done = self.refused = 0
        self.seq = 0

    async def run(self, concurrency: int, until: float) -> None:
        await self.conductor.connect(self.ctx, None, self.reg, lambda: P.Load(running=len(self.waiting)), list)
        tokens = asyncio.create_task(self._tokens())
        await asyncio.gather(*(self._client(until) for _ in range(concurrency)))
        tokens.cancel()
        self.driver.close()

    async def _client(self, until: float) -> None:
        while time.monotonic() < until:
            self.seq += 1
            wire_id = f"b{self.node_id}-{self.seq}#1"
            tokens, hashes = self.pool[self.seq % len(self.pool)]
            finished = self.waiting[wire_id] = asyncio.get_running_loop().create_future()
            submit = P.Submit(wire_id, self.node_id, tokens, hashes, self.root, P.Sampling(max_tokens=self.max_tokens),
                              in_flight=len(self.waiting) - 1, new_request=True)
            admitted = await self.conductor.ask(submit)
            if not isinstance(admitted, P.Admitted):
                self.refused += 1
                self.waiting.pop(wire_id, None)
                await asyncio.sleep(0.01)
                continue
            self.driver.drive(submit, admitted.route)
            await finished
            self.driver.end(wire_id, abort=False)
            self.conductor.release(P.Ended(wire_id, False, self.max_tokens - 1, 0.0))
            self.done += 1

    async def _tokens(self) -> None:
        while True:
            frames = await recv_multipart(self.tokens)
            msg, _ = P.decode(frames[1:])
            for e in msg.events if isinstance(msg, P.TokenStep) else [msg]:
                if e.finished is not None:
                    self._finish(e.req_id)

    def _on_prefilled(self, a: DrivenAttempt, msg: P.PrefillDone, now: float) -> None:
        self.conductor.prefilled(P.Prefilled(a.wire_id, msg, a.reserved_at - a.started, now - a.started))
        if msg.finished is not None:
            self._finish(a.wire_id)

    def _finish(self, wire_id: str) -> None:
        f = self.waiting.pop(wire_id, None)
        if f is not None and not f.done():
            f.set_result(None)


async def main_async(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    facts = bundled_facts(cfg)[0]
    pool = prompt_pool(facts, 512)
    ctx = zmq.asyncio.Context()
    fronts = [StandInFrontend(ctx, cfg, i, facts, pool, args.max_tokens) for i in range(args.frontends)]
    start = time.monotonic()
    await asyncio.gather(*(f.run(args.concurrency, start + args.duration) for f in fronts))
    wall = time.monotonic() - start
    for f in fronts:
        await f.conductor.close()  # what it still holds released first
        f.tokens.close(0)
    ctx.term()
    return {"completed": sum(f.done for f in fronts), "refused": sum(f.refused for f in fronts), "seconds": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=64, help="requests each stand-in keeps in flight")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    print(json.dumps(asyncio.run(main_async(ap.parse_args()))), flush=True)


if __name__ == "__main__":
    main()
