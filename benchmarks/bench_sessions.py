"""An agent's next turn under cache pressure, with and without a session (issue 32), through the
served path.

A dev cluster as ``mooncake serve`` starts it (one prefill, one decode, one store; caches smaller
than the traffic: ``[engine] kv_cache_bytes`` 256 MiB, store DRAM 64 MiB, no LMDB tier). ``--agents``
agents each open a conversation on a document of their own (~``--context`` words), one turn, 32
tokens out; half of them name a session (``session_id``), half do not. Then a flood of
``--flood`` unique ~1,500-token prompts from other users (no session, default class) runs to
completion, more KV than the caches hold. Then every agent sends its second turn (the first
turn, its answer, a new question). Both halves see the same cluster, flood and timing, so the
difference is the session alone: the second turn's cached prompt tokens and TTFT per half.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_sessions.py \
        [--agents 6] [--context 700] [--flood 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from benchmarks.bench_classes import Outcome, p, pressed_config, stream, text
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import running_cluster


def turn_body(messages: list[dict], session: str) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            **({"session_id": session} if session else {})}


async def agents(url: str, args: argparse.Namespace) -> tuple[list[Outcome], list[Outcome], list[bool], float]:
    """Every agent's first turn, the flood, every agent's second turn: (first turns, second turns,
    which agents name a session, the flood's seconds)."""
    sessions = [i % 2 == 0 for i in range(args.agents)]
    convs = [[{"role": "system", "content": f"Agent {i} works on this document:\n" + text(args.context, 50 + i)},
              {"role": "user", "content": f"Summarise part {i} in one line."}] for i in range(args.agents)]
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        first = []
        for i, conv in enumerate(convs):  # one at a time: the second turns below are what is compared
            first.append(await stream(client, "/v1/chat/completions",
                                      turn_body(conv, f"agent-{i}" if sessions[i] else "")))
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(client, "/v1/completions", {
            "model": MODEL, "prompt": f"Report {j}: " + text(1500, 9000 + j) + "\nVerdict:", "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}) for j in range(args.flood)))
        flood_s = time.perf_counter() - t0
        second = []
        for i, conv in enumerate(convs):
            conv = conv + [{"role": "assistant", "content": first[i].text},
                           {"role": "user", "content": "And what follows from it?"}]
            second.append(await stream(client, "/v1/chat/completions",
                                       turn_body(conv, f"agent-{i}" if sessions[i] else "")))
    return first, second, sessions, flood_s


def report(first: list[Outcome], second: list[Outcome], sessions: list[bool], flood_s: float,
           args: argparse.Namespace) -> None:
    print(f"{args.agents} agents (~{args.context}-word documents), a flood of {args.flood} unique prompts "
          f"({flood_s:.0f} s) between their turns\n")
    print("| agents | turn 1 ok | turn 2 ok | turn 2 cached tokens (median) | of its prompt | turn 2 TTFT p50 s |")
    print("|---|---|---|---|---|---|")
    for named in (True, False):
        ones = [o for o, s in zip(first, sessions) if s == named]
        twos = [o for o, s in zip(second, sessions) if s == named and o.ok]
        cached = [o.cached for o in twos]
        share = [o.cached / o.prompt for o in twos if o.prompt]
        print(f"| {'with a session' if named else 'without'} | {sum(o.ok for o in ones)}/{len(ones)} | "
              f"{len(twos)}/{len(ones)} | {statistics.median(cached) if cached else 0:.0f} | "
              f"{statistics.median(share) if share else 0:.0%} | {p([o.ttft_s for o in twos], 50):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--context", type=int, default=700, help="words of each agent's document")
    ap.add_argument("--flood", type=int, default=20)
    args = ap.parse_args()
    with running_cluster(cfg=pressed_config("bench-sessions-")) as c:
        first, second, sessions, flood_s = asyncio.run(agents(c.url, args))
    report(first, second, sessions, flood_s, args)


if __name__ == "__main__":
    main()
