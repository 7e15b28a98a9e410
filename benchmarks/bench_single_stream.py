"""Batch-1 decode: mooncake (colocated, prefill/decode pair, each also with other weights) vs
llama.cpp's ``llama-server`` on the same GGUF, in one run (issue 31).

Each system in ``--systems`` is started alone (``colocated``: ``mooncake serve --dev --colocated 1``;
``pair``: ``--prefill 1 --decode 1``; both with serve's defaults, so int4 or int8 weights where
``[model] quantization = "auto"`` picks them; ``*_unquantized``: the same with ``quantization =
"none"``, ``*_int8``: with ``"int8"``;
``llama_server``: ``-t 2 -np 4``, as in bench_e2e.py), gets one warm-up request, then ``--reps``
streamed greedy completions (``ignore_eos``) of ``--tokens`` tokens, each after a fresh
``--prompt-tokens``-token prompt (nothing cached), one at a time. Per system it reports:

* decode tokens/s: tokens after the first / time from the first to the last streamed token,
  median over reps, and its ratio to llama-server's in the same run; TTFT median;
* CPU per process while the stream decodes (first token to end): user + system time from
  ``/proc/PID/stat`` (all of a process's threads; for mooncake every process in
  ``cluster.children`` -- conductor, store0, colocated0 or prefill0 + decode0 -- and any
  process they started), in ms per generated token and as cores busy (CPU time / wall time),
  medians over reps, plus the benchmark client's own; the JSON also holds the busiest threads
  of each process (``/proc/PID/task/TID/stat``) and the whole-stream (prefill included) figures.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_single_stream.py \\
        [--systems colocated colocated_int8 colocated_unquantized pair pair_unquantized llama_server] \\
        [--reps 3] [--tokens 200] \\
        [--prompt-tokens 512] [--json PATH] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from bench_e2e import LLAMA_SERVER, LlamaServer, PeerServer, start_mooncake
from bench_role_cpu import stat_cpu_s, thread_cpu_s
from one_request import fresh_prompt
from mooncake.bench.client import RequestRecord, stream_request
from mooncake.engine.loading.loader import default_model_path
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.ports import free_port

SYSTEMS = ["colocated", "pair", "llama_server"]
CHOICES = ["colocated", "colocated_int8", "colocated_unquantized", "pair", "pair_int8", "pair_unquantized",
           "llama_server"]
QUANTIZATION = {"_unquantized": "none", "_int8": "int8"}  # a system's suffix: its [model] quantization
TOP_THREADS = 4

Snapshot = dict[str, dict[str, Any]]  # process -> {"cpu_s": float, "threads": {name:tid: cpu_s}}


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (``/proc/PID/task/TID/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def processes(server: LocalCluster | PeerServer) -> dict[str, int]:
    """Label -> pid of every process of ``server`` (a child's own children as ``child/comm:pid``)."""
    roots = ({name: p.pid for name, p in server.children.items()} if isinstance(server, LocalCluster)
             else {"llama-server": server.proc.pid})
    out: dict[str, int] = {}
    for name, root in roots.items():
        for pid in descendants(root):
            out[name if pid == root else f"{name}/{stat_cpu_s(f'/proc/{pid}/stat')[0]}:{pid}"] = pid
    return out


def snapshot(procs: dict[str, int]) -> Snapshot:
    """CPU seconds of each process and of each of its threads, now; the client (this process) too."""
    snap: Snapshot = {}
    for name, pid in {**procs, "client": os.getpid()}.items():
        try:
            snap[name] = {"cpu_s": stat_cpu_s(f"/proc/{pid}/stat")[1], "threads": thread_cpu_s(pid)}
        except FileNotFoundError:
            continue
    return snap


def cpu_delta(a: Snapshot, b: Snapshot, wall_s: float, tokens: int) -> dict[str, dict[str, Any]]:
    """Per process between two snapshots: CPU s, ms per token, cores busy, busiest threads."""
    out: dict[str, dict[str, Any]] = {}
    for name in b:
        if name not in a:
            continue
        cpu = b[name]["cpu_s"] - a[name]["cpu_s"]
        th = {t: b[name]["threads"][t] - a[name]["threads"].get(t, 0.0) for t in b[name]["threads"]}
        top = dict(sorted(((t, s) for t, s in th.items() if s > 0), key=lambda x: -x[1])[:TOP_THREADS])
        out[name] = {"cpu_s": cpu, "ms_per_token": 1e3 * cpu / max(tokens, 1), "cores": cpu / wall_s,
                     "busy_threads": sum(1 for s in th.values() if s > 0), "top_threads_s": top}
    return out


async def timed_stream(url: str, model: str, ids: list[int], max_tokens: int,
                       procs: dict[str, int]) -> tuple[RequestRecord, dict[str, Any]]:
    """One streamed greedy completion (as one_request.stream_one) with CPU snapshots at the send,
    at the first token and at the end."""
    rec = RequestRecord(0, "single", 0, 0.0)
    marks: dict[str, tuple[float, Snapshot]] = {"start": (time.perf_counter(), snapshot(procs))}

    async def at_first_token() -> None:
        while rec.ttft_s is None:
            await asyncio.sleep(0.001)
        marks["first"] = (time.perf_counter(), snapshot(procs))

    watcher = asyncio.create_task(at_first_token())
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        await stream_request(client, "/v1/completions",
                             {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True, "stream": True}, rec)
    marks["end"] = (time.perf_counter(), snapshot(procs))
    if not rec.ok or "first" not in marks:
        watcher.cancel()
        raise RuntimeError(f"request failed: {rec.status} {rec.error}")
    await watcher
    tokens = rec.completion_tokens or 0
    (t0, s0), (t1, s1), (t2, s2) = marks["start"], marks["first"], marks["end"]
    decode_s = sum(rec.itl_s)  # first to last streamed token
    return rec, {
        "tokens": tokens, "chunks": len(rec.itl_s) + 1, "ttft_s": rec.ttft_s, "decode_s": decode_s,
        "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else None,
        "decode_cpu": cpu_delta(s1, s2, t2 - t1, tokens - 1),
        "stream_cpu": cpu_delta(s0, s2, t2 - t0, tokens),
    }


def start(system: str, llama_server: Path) -> LocalCluster | PeerServer:
    t0 = time.perf_counter()
    if system == "llama_server":
        server: LocalCluster | PeerServer = LlamaServer(llama_server, default_model_path(), free_port())
        server.start()
    else:
        suffix = next((s for s in QUANTIZATION if system.endswith(s)), "")
        server = start_mooncake(system.removesuffix(suffix) if suffix else system,
                                quantization=QUANTIZATION.get(suffix, "auto"))
    print(f"[{system}] up in {time.perf_counter() - t0:.0f} s", flush=True)
    return server


def run_system(system: str, args: argparse.Namespace, seed0: int) -> dict[str, Any]:
    server = start(system, args.llama_server)
    try:
        url = server.url
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        procs = processes(server)
        asyncio.run(timed_stream(url, model, fresh_prompt(seed0, args.prompt_tokens), 32, procs))  # warm-up
        reps = []
        for r in range(args.reps):
            rec, m = asyncio.run(timed_stream(url, model, fresh_prompt(seed0 + 1 + r, args.prompt_tokens),
                                              args.tokens, procs))
            print(f"[{system}] rep {r}: {m['tokens']} tokens in {m['chunks']} chunks, TTFT {1e3 * m['ttft_s']:.0f} ms, "
                  f"decode {m['decode_tok_s']:.1f} tok/s; CPU ms/token "
                  + ", ".join(f"{k} {v['ms_per_token']:.2f}" for k, v in m["decode_cpu"].items()), flush=True)
            if m["tokens"] != args.tokens:
                print(f"[{system}] WARNING: {m['tokens']} tokens, asked for {args.tokens}", flush=True)
            reps.append(m)
        return {"processes": procs, "reps": reps, **summarize(reps)}
    finally:
        server.stop()


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    med = statistics.median
    names = [n for n in reps[0]["decode_cpu"] if all(n in r["decode_cpu"] for r in reps)]
    return {
        "decode_tok_s": med(r["decode_tok_s"] for r in reps),
        "ttft_ms": med(1e3 * r["ttft_s"] for r in reps),
        "cpu": {n: {"ms_per_token": med(r["decode_cpu"][n]["ms_per_token"] for r in reps),
                    "cores": med(r["decode_cpu"][n]["cores"] for r in reps),
                    "stream_ms_per_token": med(r["stream_cpu"][n]["ms_per_token"] for r in reps),
                    "busy_threads": med(r["decode_cpu"][n]["busy_threads"] for r in reps)}
                for n in names},
    }


def tables(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    rows = [f"Batch-1 decode, {args.prompt_tokens}-token fresh prompt, {args.tokens} greedy tokens (ignore_eos), "
            f"medians of {args.reps} reps; {os.cpu_count()} CPUs.", "",
            "| system | decode tok/s | vs llama_server | TTFT (ms) | CPU ms/token (server processes) | cores busy (server) |",
            "|---|---|---|---|---|---|"]
    for system, s in results.items():
        if "error" in s:
            rows.append(f"| {system} | FAILED: {s['error'][:200]} | | | | |")
            continue
        servers = {n: c for n, c in s["cpu"].items() if n != "client"}
        ratio = f"{s['vs_llama_server']:.2f}x" if s.get("vs_llama_server") else "-"
        rows.append(f"| {system} | {s['decode_tok_s']:.1f} | {ratio} | {s['ttft_ms']:.0f} | "
                    f"{sum(c['ms_per_token'] for c in servers.values()):.2f} | "
                    f"{sum(c['cores'] for c in servers.values()):.2f} |")
    rows += ["", "Per process, while decoding (first token to last):", "",
             "| system | process | CPU ms/token | cores busy | threads with CPU | CPU ms/token incl. prefill | busiest threads (CPU s, last rep) |",
             "|---|---|---|---|---|---|---|"]
    for system, s in results.items():
        if "error" in s:
            continue
        for n, c in s["cpu"].items():
            top = s["reps"][-1]["decode_cpu"][n]["top_threads_s"]
            rows.append(f"| {system} | {n} | {c['ms_per_token']:.2f} | {c['cores']:.2f} | {c['busy_threads']:.0f} | "
                        f"{c['stream_ms_per_token']:.2f} | "
                        + ", ".join(f"{t} {v:.2f}" for t, v in top.items()) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=CHOICES)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="the llama-server binary")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for i, system in enumerate(args.systems):
        try:
            results[system] = run_system(system, args, seed0=1000 * (i + 1))
        except Exception as exc:  # report it, go on with the others; exit non-zero at the end
            traceback.print_exc()
            print(f"[{system}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            results[system] = {"error": f"{type(exc).__name__}: {exc}"}
    base = (results.get("llama_server") or {}).get("decode_tok_s")
    for s in results.values():
        if "decode_tok_s" in s:
            s["vs_llama_server"] = s["decode_tok_s"] / base if base else None
    print(tables(results, args), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))
        print(f"-> {args.json}", flush=True)
    return 1 if any("error" in s for s in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
