"""Soak run: mixed load for many minutes against a dev cluster, with periodic kills and restarts.

Measured and recorded, never asserted (issue 6). The script starts its own cluster
(2 prefill, 2 decode, 2 store, fast failure detection, hot-block replication on, small
pools), drives it with a bounded number of concurrent clients, SIGKILLs a store and a
decode node in turn and restarts them, and records:

* every request (kind, streaming or not, prompt/max tokens, status, error, latency);
* the RSS, open fds and threads of every role process every few seconds, by role name
  (a restarted process continues its role's series), and the live node counts;
* kill / restart / rejoin events.

Outputs under ``--out-dir`` (default /tmp/mooncake-soak): ``soak.json`` (everything),
``soak.png`` (RSS per role with kill/restart markers; requests ok/failed per minute;
latencies) and ``soak.md`` (summary, also printed), plus ``metrics-end.txt``.

    .venv/bin/python benchmarks/soak.py                      # 30 minutes
    .venv/bin/python benchmarks/soak.py --minutes 2 --kill-every 40 --down 10

Ctrl-C stops the load early (in-flight requests get a few seconds), writes the outputs
and stops the cluster; a second Ctrl-C cancels in-flight requests at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import psutil

from mooncake.config import Config, MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import MODEL
from mooncake.testing.cluster import small_config

ROLES = {"prefill": 2, "decode": 2, "store": 2}
WORDS = ("the of and to in is was for on that with as by at from his her they this be are or had not but "
         "which have one were all we when there can an your their said if do will each about how up out them "
         "then she many some so these would other into has more two like him see time could no make than first "
         "been its who now people my made over did down only way find use may water long little very after "
         "words called just where most know get through back much go good new write our me man too any day "
         "same right look think also around another came come work three word must because does part even "
         "place well such here take why things help put years different away again off went old number great").split()


# ----------------------------------------------------------------------------- arguments, cluster


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="load duration")
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between kills (0: no kills)")
    p.add_argument("--down", type=float, default=20.0, help="seconds a killed node stays down before its restart")
    p.add_argument("--victims", default="store1,decode1", help="children killed in turn, comma-separated")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client-side bound on every request (s)")
    p.add_argument("--sample-every", type=float, default=3.0, help="RSS sampling interval (s)")
    p.add_argument("--prefix-groups", type=int, default=6, help="shared-prefix groups")
    p.add_argument("--shared-fraction", type=float, default=0.6, help="share of requests using a shared prefix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="/tmp/mooncake-soak")
    p.add_argument("--log-level", default="warning", help="log level of the role processes")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.concurrency < 1 or a.down < 0 or a.kill_every < 0:
        p.error("--minutes and --concurrency must be positive; --down and --kill-every not negative")
    return a


def soak_config(data_dir: Path, request_timeout_s: float) -> Config:
    """The tests' small config, with fast failure detection and replication on."""
    return small_config(data_dir, heartbeat_s=0.5, dead_after_s=2.0, hot_block_hits=2, replicas=2,
                        request_timeout_s=request_timeout_s)


# ----------------------------------------------------------------------------- workload


class Workload:
    """Seeded mix: shared-prefix groups (token ids) and unique prompts (token ids or chat text)."""

    def __init__(self, seed: int, groups: int, shared_fraction: float) -> None:
        self.rng = random.Random(seed)
        self.shared_fraction = shared_fraction
        g = random.Random(seed + 1)
        # Prefixes of 32..384 tokens (2..24 blocks); the rest of the prompt is a unique suffix.
        self.prefixes = [[g.randrange(1000, 30000) for _ in range(g.choice((32, 96, 160, 256, 384)))]
                         for _ in range(max(1, groups))]
        self.n = 0

    def next(self) -> dict[str, Any]:
        r = self.rng
        self.n += 1
        total = r.randint(50, 600)
        max_tokens = r.randint(8, 48)
        stream = r.random() < 0.5
        if r.random() < self.shared_fraction:
            gi = r.randrange(len(self.prefixes))
            prefix = self.prefixes[gi][: max(16, total - 8)]
            prompt = prefix + [r.randrange(1000, 30000) for _ in range(max(8, total - len(prefix)))]
            kind, path = f"shared{gi}", "/v1/completions"
            body: dict[str, Any] = {"prompt": prompt}
        elif r.random() < 0.5:
            kind, path = "unique", "/v1/completions"
            body = {"prompt": [r.randrange(1000, 30000) for _ in range(total)]}
        else:
            kind, path = "chat", "/v1/chat/completions"
            text = " ".join(r.choice(WORDS) for _ in range(max(10, total - 20)))  # ~1 token a word
            body = {"messages": [{"role": "user", "content": text}]}
        body.update(model=MODEL, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return {"id": self.n, "kind": kind, "path": path, "stream": stream, "prompt_len": total,
                "max_tokens": max_tokens, "body": body}


def _err_message(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        obj = json.loads(text)
        err = obj.get("error", obj.get("detail")) if isinstance(obj, dict) else None
        if isinstance(err, dict):
            return f"{err.get('code') or err.get('type') or ''}: {err.get('message', '')}".strip(": ")
        if err is not None:
            return str(err)
    except (json.JSONDecodeError, AttributeError):
        pass
    return text[:300] or "(empty body)"


async def one_request(client: httpx.AsyncClient, spec: dict[str, Any], t0: float, timeout_s: float) -> dict[str, Any]:
    rec: dict[str, Any] = {k: spec[k] for k in ("id", "kind", "path", "stream", "prompt_len", "max_tokens")}
    rec.update(start_s=time.monotonic() - t0, ok=False, status=None, error=None, ttft_s=None,
               completion_tokens=None, cached_tokens=None, text="", chunks=0)
    start = time.monotonic()

    async def run() -> None:
        if not spec["stream"]:
            r = await client.post(spec["path"], json=spec["body"])
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = _err_message(r.content)
                return
            obj = r.json()
            usage = obj.get("usage") or {}
            choice = (obj.get("choices") or [{}])[0]
            rec["text"] = choice.get("text") or (choice.get("message") or {}).get("content") or ""
            rec["completion_tokens"] = usage.get("completion_tokens")
            rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            rec["ok"] = True
            return
        async with client.stream("POST", spec["path"], json=spec["body"]) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = _err_message(await r.aread())
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = "in-stream " + _err_message(data)
                    continue  # the server still sends [DONE]
                if obj.get("choices"):
                    if rec["ttft_s"] is None:
                        rec["ttft_s"] = time.monotonic() - start
                    ch = obj["choices"][0]
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    rec["text"] += piece
                    rec["chunks"] += bool(piece)
                if obj.get("usage"):
                    rec["completion_tokens"] = obj["usage"].get("completion_tokens")
                    rec["cached_tokens"] = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            if rec["error"] is None and not done:
                rec["error"] = "stream ended without [DONE]"
            rec["ok"] = rec["error"] is None

    try:
        await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        rec["error"] = f"client timeout after {timeout_s:.0f}s"
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    except (json.JSONDecodeError, ValueError) as e:
        rec["error"] = f"malformed response: {e}"[:300]
    rec["e2e_s"] = time.monotonic() - start
    rec["end_s"] = time.monotonic() - t0
    if rec["ok"] and rec["completion_tokens"] is not None and rec["completion_tokens"] != spec["max_tokens"]:
        rec["token_mismatch"] = True  # ignore_eos: exactly max_tokens expected; else tokens lost or duplicated
    return rec


# ----------------------------------------------------------------------------- the run


class Soak:
    def __init__(self, args: argparse.Namespace, cluster: LocalCluster) -> None:
        self.a = args
        self.c = cluster
        self.t0 = time.monotonic()
        self.duration = args.minutes * 60.0
        self.stop = asyncio.Event()
        self.interrupted = False
        self.records: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.nodes: list[dict[str, Any]] = []
        self.inflight: set[asyncio.Task] = set()
        self.sent = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, kind: str, name: str, **extra: Any) -> None:
        ev = {"t_s": round(self.now(), 2), "event": kind, "name": name, **extra}
        self.events.append(ev)
        print(f"[soak {ev['t_s']:7.1f}s] {kind} {name} {extra if extra else ''}", flush=True)

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True when stopped."""
        try:
            await asyncio.wait_for(self.stop.wait(), max(0.0, seconds))
            return True
        except asyncio.TimeoutError:
            return False

    async def client_loop(self, client: httpx.AsyncClient, wl: Workload) -> None:
        while not self.stop.is_set() and self.now() < self.duration:
            spec = wl.next()
            self.sent += 1
            task = asyncio.create_task(one_request(client, spec, self.t0, self.a.request_timeout))
            self.inflight.add(task)
            try:
                rec = await task
            except asyncio.CancelledError:
                rec = {k: spec[k] for k in ("id", "kind", "path", "stream", "prompt_len", "max_tokens")}
                rec.update(start_s=None, end_s=self.now(), ok=False, status=None, error="cancelled at shutdown",
                           e2e_s=None)
                self.records.append(rec)
                return
            finally:
                self.inflight.discard(task)
            self.records.append(rec)

    async def sampler(self, client: httpx.AsyncClient) -> None:
        procs: dict[str, tuple[int, psutil.Process]] = {}
        while True:
            t = round(self.now(), 2)
            for name, popen in list(self.c.children.items()):
                if popen.poll() is not None:
                    continue
                if name not in procs or procs[name][0] != popen.pid:
                    try:
                        procs[name] = (popen.pid, psutil.Process(popen.pid))
                    except psutil.Error:
                        continue
                p = procs[name][1]
                try:
                    with p.oneshot():
                        mem, fds, threads = p.memory_info(), p.num_fds(), p.num_threads()
                    rss, shared = mem.rss, getattr(mem, "shared", 0)  # shared: file/shm-backed resident pages
                    for ch in p.children(recursive=True):
                        try:
                            cm = ch.memory_info()
                            rss, shared = rss + cm.rss, shared + getattr(cm, "shared", 0)
                        except psutil.Error:
                            pass
                except psutil.Error:
                    continue
                self.samples[name].append({"t_s": t, "pid": popen.pid, "rss_mib": round(rss / MiB, 2),
                                           "shared_mib": round(shared / MiB, 2), "fds": fds, "threads": threads})
            try:
                r = await client.get("/health", timeout=2.0)
                self.nodes.append({"t_s": t, **r.json().get("nodes", {})})
            except (httpx.HTTPError, ValueError):
                self.nodes.append({"t_s": t, "error": True})
            if await self.sleep(self.a.sample_every):
                return

    async def chaos(self, client: httpx.AsyncClient) -> None:
        victims = [v.strip() for v in self.a.victims.split(",") if v.strip()]
        if not self.a.kill_every or not victims:
            return
        k = 0
        while True:
            at = (k + 1) * self.a.kill_every
            if at + self.a.down + 5 > self.duration:  # end the run with a whole cluster
                return
            if await self.sleep(at - self.now()):
                return
            name = victims[k % len(victims)]
            k += 1
            role, index = re.fullmatch(r"([a-z]+)(\d+)", name).groups()  # type: ignore[union-attr]
            pid = self.c.children[name].pid
            await asyncio.to_thread(self.c.kill, name)
            self.event("kill", name, pid=pid)
            asyncio.create_task(self.watch_nodes(client, role, ROLES[role] - 1, f"{name} declared dead"))
            stopped = await self.sleep(self.a.down)
            proc = self.c.spawn(role, int(index))  # restart even when stopping: cleanup is uniform
            self.event("restart", name, pid=proc.pid)
            if stopped:
                return
            asyncio.create_task(self.watch_nodes(client, role, ROLES[role], f"{name} rejoined"))

    async def watch_nodes(self, client: httpx.AsyncClient, role: str, want: int, what: str) -> None:
        t_start = self.now()
        while not self.stop.is_set() and self.now() - t_start < 180:
            try:
                n = (await client.get("/health", timeout=2.0)).json()["nodes"].get(role, -1)
                if n == want:
                    self.event("observed", what, after_s=round(self.now() - t_start, 2))
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.25)
        if not self.stop.is_set():
            self.event("not-observed", what, waited_s=round(self.now() - t_start, 2))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        presses = 0

        def on_signal() -> None:
            nonlocal presses
            presses += 1
            self.interrupted = True
            self.stop.set()
            if presses == 1:
                print("\n[soak] stopping: waiting a few seconds for in-flight requests (Ctrl-C again: cancel)",
                      flush=True)
            for t in list(self.inflight) if presses > 1 else ():
                t.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        wl = Workload(self.a.seed, self.a.prefix_groups, self.a.shared_fraction)
        limits = httpx.Limits(max_connections=self.a.concurrency + 4)
        async with httpx.AsyncClient(base_url=self.c.url, timeout=self.a.request_timeout, limits=limits) as client:
            self.t0 = time.monotonic()
            self.event("load-start", "clients", concurrency=self.a.concurrency)
            sampler = asyncio.create_task(self.sampler(client))
            chaos = asyncio.create_task(self.chaos(client))
            progress = asyncio.create_task(self.progress())
            clients = [asyncio.create_task(self.client_loop(client, wl)) for _ in range(self.a.concurrency)]
            done_at_deadline = asyncio.gather(*clients)
            stopper = asyncio.create_task(self.stop.wait())
            await asyncio.wait({done_at_deadline, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if self.stop.is_set() and not done_at_deadline.done():
                await asyncio.wait({done_at_deadline}, timeout=5.0)  # grace for in-flight requests
                for t in list(self.inflight):
                    t.cancel()
            await asyncio.gather(done_at_deadline, return_exceptions=True)
            self.event("load-end", "clients", interrupted=self.interrupted)
            self.stop.set()
            await asyncio.gather(sampler, chaos, progress, stopper, return_exceptions=True)
            try:
                self.metrics_text = (await client.get("/metrics", timeout=10)).text
            except httpx.HTTPError as e:
                self.metrics_text = f"# /metrics failed: {e}\n"
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    async def progress(self) -> None:
        while not await self.sleep(30.0):
            ok = sum(r["ok"] for r in self.records)
            live = {n for n, p in self.c.children.items() if p.poll() is None}
            rss = {n: s[-1]["rss_mib"] for n, s in self.samples.items() if s and n in live}
            print(f"[soak {self.now():7.1f}s] sent {self.sent} ok {ok} failed {len(self.records) - ok}  "
                  f"RSS MiB {json.dumps({k: round(v) for k, v in rss.items()})}", flush=True)


# ----------------------------------------------------------------------------- outputs


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def _mask(msg: str) -> str:
    """Group error messages that differ only in ids/numbers."""
    msg = re.sub(r"\b[0-9a-f]{8,}\b", "<hex>", msg)
    msg = re.sub(r"node\d+-(\w+)-\d+", r"node<n>-\1", msg)
    return re.sub(r"\d+(\.\d+)?", "N", msg)


def summarize(soak: Soak, args: argparse.Namespace, command: str, started: str, wall_s: float,
              startup_s: float) -> dict[str, Any]:
    recs = soak.records
    ok = [r for r in recs if r["ok"]]
    failed = [r for r in recs if not r["ok"]]
    groups: dict[tuple, dict[str, Any]] = {}
    for r in failed:
        key = (r["status"] if r["status"] is not None else "none", _mask(r["error"] or "?"))
        g = groups.setdefault(key, {"status": key[0], "message": key[1], "count": 0, "example": r["error"],
                                    "first_s": r.get("end_s"), "last_s": r.get("end_s"), "stream": 0})
        g["count"] += 1
        g["stream"] += bool(r["stream"])
        g["last_s"] = r.get("end_s")
    minutes = int(max([r.get("end_s") or 0 for r in recs] + [soak.duration]) // 60) + 1
    per_min = [{"minute": m, "ok": 0, "failed": 0} for m in range(minutes)]
    for r in recs:
        m = min(minutes - 1, int((r.get("end_s") or 0) // 60))
        per_min[m]["ok" if r["ok"] else "failed"] += 1
    rss = {}
    for name, s in sorted(soak.samples.items()):
        lives = sorted({x["pid"] for x in s}, key=[x["pid"] for x in s].index)
        rss[name] = {"start_mib": s[0]["rss_mib"], "peak_mib": max(x["rss_mib"] for x in s),
                     "end_mib": s[-1]["rss_mib"], "lives": len(lives), "samples": len(s),
                     "fds_start": s[0]["fds"], "fds_end": s[-1]["fds"],
                     "threads_start": s[0]["threads"], "threads_end": s[-1]["threads"],
                     "shared_start_mib": s[0]["shared_mib"], "shared_end_mib": s[-1]["shared_mib"],
                     "end_of_first_life_mib": [x for x in s if x["pid"] == lives[0]][-1]["rss_mib"]}
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for r in recs:
        k = ("stream " if r["stream"] else "plain ") + ("chat" if r["kind"] == "chat" else r["kind"].rstrip("0123456789"))
        by_kind[k]["sent"] += 1
        by_kind[k]["ok" if r["ok"] else "failed"] += 1
    metrics = {}
    for line in getattr(soak, "metrics_text", "").splitlines():
        m = re.match(r"^(mooncake:(?:requests_total|requests_rejected_total|migrations_total|replications_total)"
                     r"(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m:
            metrics[m.group(1)] = float(m.group(2))
    e2e = [r["e2e_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    return {
        "command": command, "started_utc": started, "interrupted": soak.interrupted,
        "planned_s": soak.duration, "load_s": round(max([r.get("end_s") or 0 for r in recs] + [0]), 1),
        "wall_s": round(wall_s, 1), "cluster_startup_s": round(startup_s, 1), "args": vars(args),
        "cluster": {"roles": ROLES, "heartbeat_s": 0.5, "dead_after_s": 2.0, "hot_block_hits": 2, "replicas": 2,
                    "kv_cache_mib": 160, "dram_mib": 128, "lmdb_mib": 256, "engine_threads": 1},
        "requests": {"sent": soak.sent, "finished": len(recs), "ok": len(ok), "failed": len(failed),
                     "token_mismatch": [{"id": r["id"], "max_tokens": r["max_tokens"],
                                         "completion_tokens": r["completion_tokens"], "stream": r["stream"],
                                         "start_s": r["start_s"], "end_s": r["end_s"]}
                                        for r in ok if r.get("token_mismatch")],
                     "cached_tokens_total": sum(r.get("cached_tokens") or 0 for r in ok),
                     "e2e_p50_s": _pct(e2e, 0.5), "e2e_p95_s": _pct(e2e, 0.95), "e2e_max_s": max(e2e, default=None),
                     "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
                     "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}},
        "failures": sorted(groups.values(), key=lambda g: -g["count"]),
        "per_minute": per_min, "rss": rss, "server_metrics": metrics, "events": soak.events,
    }


def markdown(s: dict[str, Any]) -> str:
    q = s["requests"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        "# mooncake soak run", "",
        f"Command: `{s['command']}`", "",
        f"Started {s['started_utc']}; load {s['load_s']:.0f}s of {s['planned_s']:.0f}s planned"
        f"{' (interrupted)' if s['interrupted'] else ''}; wall {s['wall_s']:.0f}s "
        f"(cluster start {s['cluster_startup_s']:.0f}s). Cluster: 2 prefill, 2 decode, 2 store; heartbeat 0.5s, "
        f"dead after 2s; hot_block_hits 2, replicas 2; KV pool 160 MiB, DRAM 128 MiB, LMDB 256 MiB; "
        f"{s['args']['concurrency']} clients, request timeout {s['args']['request_timeout']:.0f}s.", "",
        "## Requests", "",
        f"Sent {q['sent']}, finished {q['finished']}, **ok {q['ok']}**, **failed {q['failed']}**"
        f" ({100 * q['failed'] / max(1, q['finished']):.1f}%); ok but completion_tokens != max_tokens "
        f"(all requests use ignore_eos): **{len(q['token_mismatch'])}**; cached prompt tokens reported: {q['cached_tokens_total']}.", "",
        f"Latency of ok requests: e2e p50 {f(q['e2e_p50_s'])}s, p95 {f(q['e2e_p95_s'])}s, max {f(q['e2e_max_s'])}s;"
        f" streaming TTFT p50 {f(q['ttft_p50_s'])}s, p95 {f(q['ttft_p95_s'])}s.", "",
        *(["Token-count mismatches: " + "; ".join(
            f"#{m['id']} {m['completion_tokens']} of {m['max_tokens']} ({'stream' if m['stream'] else 'plain'}, "
            f"{m['start_s']:.0f}s..{m['end_s']:.0f}s)" for m in q["token_mismatch"]), ""] if q["token_mismatch"] else []),
        "| kind | sent | ok | failed |", "|---|---:|---:|---:|",
        *[f"| {k} | {v.get('sent', 0)} | {v.get('ok', 0)} | {v.get('failed', 0)} |" for k, v in q["by_kind"].items()],
        "", "## Failures", "",
    ]
    if s["failures"]:
        lines += ["| status | count | streaming | first..last (s) | message (example) |", "|---|---:|---:|---|---|"]
        for g in s["failures"]:
            ex = (g["example"] or "").replace("|", "\\|")[:200]
            lines.append(f"| {g['status']} | {g['count']} | {g['stream']} | {f(g['first_s'], 0)}..{f(g['last_s'], 0)}"
                         f" | {ex} |")
    else:
        lines.append("None.")
    lines += ["", "## Kills and restarts", ""]
    evs = [e for e in s["events"] if e["event"] in ("kill", "restart", "observed", "not-observed")]
    if evs:
        lines += ["| t (s) | event | what | detail |", "|---:|---|---|---|"]
        for e in evs:
            detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("t_s", "event", "name"))
            lines.append(f"| {e['t_s']:.1f} | {e['event']} | {e['name']} | {detail} |")
    else:
        lines.append("None.")
    lines += ["", "## RSS per role (MiB)", "",
              "RSS includes `shared` (resident file- and shm-backed pages: LMDB maps, shared-memory segments); "
              "a restarted role continues its series (`lives` > 1).", "",
              "| role | start | peak | end | end - start | lives | end of 1st life | shared start/end "
              "| fds start/end | threads start/end |",
              "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for name, r in s["rss"].items():
        lines.append(f"| {name} | {r['start_mib']:.0f} | {r['peak_mib']:.0f} | {r['end_mib']:.0f} | "
                     f"{r['end_mib'] - r['start_mib']:+.0f} | {r['lives']} | {r['end_of_first_life_mib']:.0f} | "
                     f"{r['shared_start_mib']:.0f}/{r['shared_end_mib']:.0f} | {r['fds_start']}/{r['fds_end']} | {r['threads_start']}/{r['threads_end']} |")
    if s["server_metrics"]:
        lines += ["", "## Server counters at the end", "", "| metric | value |", "|---|---:|",
                  *[f"| `{k}` | {v:g} |" for k, v in sorted(s["server_metrics"].items())]]
    lines += ["", "Per-minute counts, every request and every RSS sample are in soak.json; plot in soak.png.", ""]
    return "\n".join(lines)


def plot(soak: Soak, s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(12, 11), gridspec_kw={"height_ratios": [3, 1.4, 1.6]})
    for name, samples in sorted(soak.samples.items()):
        # A gap (NaN) where the process was down, so a restart does not draw a connecting line.
        xs, ys, last_pid = [], [], None
        for x in samples:
            if last_pid is not None and x["pid"] != last_pid:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(x["t_s"] / 60)
            ys.append(x["rss_mib"])
            last_pid = x["pid"]
        ax1.plot(xs, ys, label=name, lw=1.4)
    for ax in (ax1, ax3):
        for e in s["events"]:
            if e["event"] in ("kill", "restart"):
                ax.axvline(e["t_s"] / 60, color="red" if e["event"] == "kill" else "green",
                           ls="--" if e["event"] == "kill" else ":", lw=1, alpha=0.8)
    top = ax1.get_ylim()[1]
    for e in s["events"]:
        if e["event"] in ("kill", "restart"):
            ax1.text(e["t_s"] / 60, top, f" {e['event']} {e['name']}", rotation=90, va="top", ha="right",
                     fontsize=7, color="red" if e["event"] == "kill" else "green")
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_title("mooncake soak: RSS per role (red dashed: SIGKILL, green dotted: restart)")
    ax1.legend(loc="center left", fontsize=8, ncol=1, bbox_to_anchor=(1.0, 0.5))
    ax1.grid(alpha=0.3)
    pm = s["per_minute"]
    xs = [p["minute"] for p in pm]
    ax2.bar(xs, [p["ok"] for p in pm], color="tab:green", label="ok", align="edge", width=0.9)
    ax2.bar(xs, [p["failed"] for p in pm], bottom=[p["ok"] for p in pm], color="tab:red", label="failed",
            align="edge", width=0.9)
    ax2.set_ylabel("requests / minute")
    ax2.set_xlabel("minute (by request end)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, axis="y")
    okr = [r for r in soak.records if r["ok"] and r.get("end_s") is not None]
    bad = [r for r in soak.records if not r["ok"] and r.get("end_s") is not None]
    ax3.scatter([r["end_s"] / 60 for r in okr], [r["e2e_s"] for r in okr], s=6, c="tab:green", label="ok")
    ax3.scatter([r["end_s"] / 60 for r in bad], [r["e2e_s"] or 0 for r in bad], s=18, c="tab:red", marker="x",
                label="failed")
    ax3.set_ylabel("e2e latency (s)")
    ax3.set_xlabel("time (min, by request end)")
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3)
    ax1.set_xlim(left=0)
    ax3.set_xlim(ax1.get_xlim())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join([os.path.relpath(sys.executable, Path.cwd()) if sys.executable.startswith(str(Path.cwd()))
                          else sys.executable, *sys.argv])
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    data_dir = Path(tempfile.mkdtemp(prefix="mooncake-soak-data-"))
    cluster = LocalCluster(soak_config(data_dir, args.request_timeout), log_level=args.log_level, **ROLES)
    wall0 = time.monotonic()
    soak: Soak | None = None
    startup_s = 0.0
    rc = 0
    try:
        print(f"[soak] starting a dev cluster (2 prefill, 2 decode, 2 store) at {cluster.url} ...", flush=True)
        try:
            cluster.start(timeout_s=300)
        except KeyboardInterrupt:
            print("[soak] interrupted during cluster start", flush=True)
            return 130
        startup_s = time.monotonic() - wall0
        print(f"[soak] cluster ready in {startup_s:.1f}s; load for {args.minutes:g} min", flush=True)
        soak = Soak(args, cluster)
        asyncio.run(soak.run())
        rc = 130 if soak.interrupted else 0
    except (RuntimeError, TimeoutError) as e:
        print(f"[soak] error: {e}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        print("[soak] stopping the cluster ...", flush=True)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        try:
            cluster.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            import shutil

            shutil.rmtree(data_dir, ignore_errors=True)
    if soak is not None:
        s = summarize(soak, args, command, started, time.monotonic() - wall0, startup_s)
        full = {**s, "records": soak.records, "rss_samples": dict(soak.samples), "node_counts": soak.nodes}
        (out / "soak.json").write_text(json.dumps(full, indent=1))
        (out / "metrics-end.txt").write_text(getattr(soak, "metrics_text", ""))
        md = markdown(s)
        (out / "soak.md").write_text(md)
        try:
            plot(soak, s, out / "soak.png")
        except Exception as e:  # a plot failure must not lose the data
            print(f"[soak] plot failed: {e}", file=sys.stderr)
        print(md)
        print(f"[soak] wrote {out / 'soak.json'}, {out / 'soak.png'}, {out / 'soak.md'}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
