"""The routing layer's capacity against workers that answer instantly (issues 14 and 29).

``--target frontend`` (default): one real frontend process (``mooncake serve --role frontend``:
uvicorn, the tokenizer, block hashing, SSE, streaming detokenization) on core 0, against a real
conductor (no frontend of its own), stand-in prefill, decode and store instances in one process
(``standin_workers.py``: real ZeroMQ links and messages, no model) and the load generator, all on
core 1. ``--target bundled``: the conductor with its in-process frontend on core 0 (what one
process serving everything costs). The load: an open-loop Poisson of ``/v1/completions`` text
prompts of 200-2,000 tokens, half of them opening with one of 8 shared prefixes, half streamed,
16 tokens each (the decode stand-in steps its batch as a real decode does, every ``--step-ms``:
one token per request per step, a step's tokens in one ``TokenStep`` to the request's frontend).
The capacity is searched with ``mooncake.bench.capacity`` over the offered rate: a rate passes
when >= 99% of the requests it sends complete within ``--bound-ms`` end to end; then closed
loops of ``--concurrency`` clients give the throughput with the measured process's core
saturated. Every step starts from an idle process. Per step: completions/s, latency p50/p99, the
measured process's CPU (``/proc/PID/stat``) per request, its garbage-collection pauses (counted by
``profiled_conductor.py``, the wrapper it runs under), the conductor's CPU per request, and each
process's share of a core. ``--profile`` runs one more step under cProfile (the measured
process's event loop) and reports its time by component.

``--target conductor``: the conductor alone on core 0 (no HTTP at all) against stand-in workers
and stand-in frontends (``standin_frontends.py``: every message a frontend exchanges per request,
closed loop) on core 1: the conductor's plans per second and CPU per request, at each
``--concurrency`` (requests in flight per stand-in frontend).

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_conductor.py \
        [--target frontend|bundled|conductor] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from mooncake.bench.capacity import CapacityPlan, search_capacity
from mooncake.config import Config, load_config
from mooncake.config_toml import dump_toml
from mooncake.testing.ports import free_port

from bench_role_cpu import stat_cpu_s, thread_cpu_s
from conductor_load import offer, pct, prompts
from conductor_profile import components, top_functions

HERE = Path(__file__).resolve().parent
TARGET = 0.99  # a rate passes when this fraction of its requests meets the bound


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    return stat_cpu_s(f"/proc/{pid}/stat")[1]


def bench_config(tmp: Path, frontend: str) -> Path:
    cfg = Config()
    cfg.node.health_port = free_port()  # a conductor without a frontend serves /metrics there
    cfg.model.dtype = "float32"
    cfg.frontend.port = free_port()
    cfg.conductor.endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg.conductor.frontend = frontend  # type: ignore[assignment]
    cfg.liveness.dead_after_s = 30.0  # a saturated stand-in's late heartbeat is not a death
    path = tmp / "cluster.toml"
    path.write_text(dump_toml(cfg))
    return path


def serve(role: str, path: Path, core: int | None, profiled: Path | None = None, cprofile: bool = False
          ) -> subprocess.Popen:
    """``mooncake serve --role ROLE`` (under ``profiled_conductor.py`` when ``profiled``: its GC
    pauses counted, cProfile with ``cprofile``), on ``core``."""
    run = [str(HERE / "profiled_conductor.py"), str(profiled)] if profiled else ["-m", "mooncake.cli"]
    cmd = (["taskset", "-c", str(core)] if core is not None else []) + [
        sys.executable, *run, "serve", "--role", role, "--config", str(path), "--log-level", "warning"]
    return subprocess.Popen(cmd, env={**os.environ, "BENCH_CONDUCTOR_CPROFILE": "1" if cprofile else "0"})


def standins(path: Path, args: argparse.Namespace) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "standin_workers.py"), "--config", str(path),
                             "--prefill", str(args.prefill), "--decode", str(args.decode),
                             "--tokens-per-event", str(args.tokens_per_event), "--step-ms", str(args.step_ms)]
                            + (["--per-request-events"] if args.per_request_events else []))


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def served(pin: bool, cprofile: bool, args: argparse.Namespace) -> Iterator[tuple[str, dict, Path]]:
    """(base URL, {"measured": pid, "conductor": pid, "workers": pid}, profile path) of a running
    routing layer (``--target``) with stand-ins; the measured process on core 0 under the wrapper."""
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-conductor-"))
    out = tmp / "measured.prof"
    bundled = args.target == "bundled"
    path = bench_config(tmp, "on" if bundled else "off")
    if pin:
        os.sched_setaffinity(0, {1})  # this process and the stand-ins: core 1
    core = 0 if pin else None
    procs = [serve("conductor", path, core if bundled else None, out if bundled else None, cprofile)]
    if not bundled:
        procs.append(serve("frontend", path, core, out, cprofile))
    procs.append(standins(path, args))
    url = f"http://127.0.0.1:{load_config(path).frontend.port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a process exited during start-up")
            try:
                nodes = httpx.get(url + "/health", timeout=2).json()["nodes"]
                if nodes.get("prefill", 0) >= args.prefill and nodes.get("decode", 0) >= args.decode \
                        and nodes.get("store"):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("not ready in 120 s")
            time.sleep(0.25)
        yield url, {"measured": procs[-2].pid, "conductor": procs[0].pid, "workers": procs[-1].pid}, out
    finally:
        stop_all(procs[::-1])


def gc_pauses(pid: int, out: Path) -> dict[str, list[float]]:
    """Stop the conductor's counting (SIGUSR2) and read its GC pauses per generation."""
    gc_file = Path(str(out) + ".gc.json")
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not gc_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the conductor wrote no GC counts")
        time.sleep(0.05)
    counts = json.loads(gc_file.read_text())
    gc_file.unlink()
    return counts


def wait_idle(pid: int, timeout_s: float = 120.0) -> None:
    """Until the conductor has worked off what an earlier step left (a step past capacity leaves
    a backlog): under 5% of a core over half a second."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = proc_cpu_s(pid)
        time.sleep(0.5)
        if proc_cpu_s(pid) - before < 0.025:
            return
    raise TimeoutError(f"the conductor was still busy {timeout_s:.0f} s after the step")


def measure(url: str, model: str, pids: dict[str, int], prof: Path, rate: float, args: argparse.Namespace,
            texts: list[str], seed: int, concurrency: int = 0) -> dict:
    """One step at ``rate`` (or closed loop), from an idle conductor: its latencies, completions/s,
    CPU per process, GC."""
    wait_idle(pids["measured"])
    before = {k: proc_cpu_s(p) for k, p in pids.items()}
    t_cpu0 = time.process_time()
    os.kill(pids["measured"], signal.SIGUSR1)
    res = asyncio.run(offer(url, model, rate, args.duration, texts, args.max_tokens, args.grace, seed, concurrency))
    gc_counts = gc_pauses(pids["measured"], prof)
    cpu = {k: proc_cpu_s(p) - before[k] for k, p in pids.items()}
    cpu["loadgen"] = time.process_time() - t_cpu0
    ok = [e for good, e, _ in res["results"] if good]
    n_ok, wall = max(1, len(ok)), res["wall_s"]
    gen2_n, gen2_s = gc_counts["2"]
    return {"rate": rate, "concurrency": concurrency, "sent": res["sent"], "ok": len(ok),
            "attainment": sum(1 for e in ok if e * 1000 <= args.bound_ms) / max(1, res["sent"]),
            "completed_per_s": len(ok) / wall, "p50_ms": pct(ok, 50) * 1000, "p99_ms": pct(ok, 99) * 1000,
            "measured_ms_per_req": 1000 * cpu["measured"] / n_ok, "conductor_ms_per_req": 1000 * cpu["conductor"] / n_ok,
            "gc_ms_per_req": 1000 * sum(s for _, s in gc_counts.values()) / n_ok,
            "gen2": f"{gen2_n:.0f} × {1000 * gen2_s / max(1, gen2_n):.0f} ms",
            **{f"{k}_util": cpu[k] / wall for k in cpu}}


def table(rows: list[dict]) -> str:
    lines = ["| offered | sent | completed req/s | within bound | e2e p50 ms | e2e p99 ms | measured CPU ms/req "
             "| of it GC ms/req | gen-2 GCs | measured core | conductor CPU ms/req | stand-ins core | load gen core |",
             "|" + "---|" * 13]
    for r in rows:
        offered = f"{r['concurrency']} clients" if r["concurrency"] else f"{r['rate']:.0f} req/s"
        lines.append(f"| {offered} | {r['sent']} | {r['completed_per_s']:.1f} | {100 * r['attainment']:.1f}% "
                     f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['measured_ms_per_req']:.2f} "
                     f"| {r['gc_ms_per_req']:.2f} | {r['gen2']} | {100 * r['measured_util']:.0f}% "
                     f"| {r['conductor_ms_per_req']:.2f} "
                     f"| {100 * r['workers_util']:.0f}% | {100 * r['loadgen_util']:.0f}% |")
    return "\n".join(lines)


def warm(url: str, args: argparse.Namespace, texts: list[str]) -> str:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    asyncio.run(offer(url, model, 5, 2.0, texts, args.max_tokens, 10, seed=0))
    return model


def run_search(args: argparse.Namespace, texts: list[str]) -> tuple[list[dict], list[dict], float | None]:
    """(open-loop rows, closed-loop rows, capacity in req/s or None)."""
    rows: list[dict] = []
    with served(args.pin, False, args) as (url, pids, prof):
        model = warm(url, args, texts)

        def step(rate: float, concurrency: int = 0) -> dict:
            rows.append(measure(url, model, pids, prof, rate, args, texts, len(rows) + 1, concurrency))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            return rows[-1]

        if args.rates:
            capacity = max((r for r in args.rates if step(r)["attainment"] >= TARGET), default=None)
        else:
            plan = CapacityPlan(start=1.0, growth=2.0, target=TARGET, max_scale=args.max_rate / args.start_rate,
                                min_scale=0.25, max_rates=args.max_steps, bisect_steps=3)
            result = search_capacity(lambda scale: step(args.start_rate * scale)["attainment"], plan)
            capacity = result.capacity * args.start_rate if result.capacity is not None else None
        open_rows = list(rows)
        for n in args.concurrency:
            step(0.0, n)
        return open_rows, rows[len(open_rows):], capacity


def run_profile(args: argparse.Namespace, texts: list[str], rate: float) -> str:
    with served(args.pin, True, args) as (url, pids, prof):
        model = warm(url, args, texts)
        threads0 = thread_cpu_s(pids["measured"])
        row = measure(url, model, pids, prof, rate, args, texts, seed=99)
        threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu_s(pids["measured"]).items()}
        busy = sorted(((v, k) for k, v in threads.items() if v > 0.005), reverse=True)
        lines = [f"profiled step (the measured process's event loop under cProfile: slower than without):\n\n"
                 f"{table([row])}\n", "measured process's threads, CPU ms per completed request: " +
                 ", ".join(f"{k} {1000 * v / max(1, row['ok']):.2f}" for v, k in busy) + "\n",
                 "event-loop thread by component (cProfile own time, share of the busy total):\n",
                 "| component | share |", "|---|---|"]
        lines += [f"| {name} | {100 * share:.1f}% |" for name, share in components(prof)]
        lines += ["", "top functions by own time:", "", "| function | own s | calls |", "|---|---|---|"]
        lines += [f"| {fn} | {tt:.3f} | {n} |" for fn, tt, n in top_functions(prof, 25)]
    return "\n".join(lines)


def conductor_alone(args: argparse.Namespace) -> str:
    """The conductor alone on core 0 against stand-in workers and stand-in frontends on core 1:
    a table of its plans per second and CPU per request at each ``--concurrency``."""
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-conductor-"))
    out = tmp / "measured.prof"
    path = bench_config(tmp, "off")
    cfg = load_config(path)
    if args.pin:
        os.sched_setaffinity(0, {1})
    procs = [serve("conductor", path, 0 if args.pin else None, out, bool(args.profile)), standins(path, args)]
    rows = ["| stand-in frontends × requests in flight | completed req/s (plans/s) | conductor CPU ms/req "
            "| of it GC ms/req | conductor core | stand-ins core | refused |", "|" + "---|" * 7]
    try:
        metrics = f"http://127.0.0.1:{cfg.node.health_port}/metrics"
        deadline = time.monotonic() + 120
        while not _registered(metrics, args):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the conductor or the stand-ins did not come up")
            time.sleep(0.25)
        pid = procs[0].pid
        for concurrency in args.concurrency:
            wait_idle(pid)
            before = {"conductor": proc_cpu_s(pid), "workers": proc_cpu_s(procs[1].pid)}
            os.kill(pid, signal.SIGUSR1)
            r = subprocess.run([sys.executable, str(HERE / "standin_frontends.py"), "--config", str(path),
                                "--frontends", str(args.frontends), "--concurrency", str(concurrency),
                                "--duration", str(args.duration), "--max-tokens", str(args.max_tokens)],
                               capture_output=True, text=True, check=True)
            res = json.loads(r.stdout.strip().splitlines()[-1])
            gc_counts = gc_pauses(pid, out)
            cpu = {"conductor": proc_cpu_s(pid) - before["conductor"],
                   "workers": proc_cpu_s(procs[1].pid) - before["workers"]}
            n, wall = max(1, res["completed"]), res["seconds"]
            rows.append(f"| {args.frontends} × {concurrency} | {res['completed'] / wall:.0f} "
                        f"| {1000 * cpu['conductor'] / n:.3f} "
                        f"| {1000 * sum(s for _, s in gc_counts.values()) / n:.3f} "
                        f"| {100 * cpu['conductor'] / wall:.0f}% | {100 * cpu['workers'] / wall:.0f}% "
                        f"| {res['refused']} |")
            print(rows[-1], flush=True)
    finally:
        stop_all(procs[::-1])
    if args.profile:  # the last step's, under cProfile (slower than without)
        rows += ["", "| function | own s | calls |", "|---|---|---|"]
        rows += [f"| {fn} | {tt:.3f} | {n} |" for fn, tt, n in top_functions(out, 25)]
    return "\n".join(rows)


def _registered(metrics_url: str, args: argparse.Namespace) -> bool:
    from mooncake.testing.api import metric

    try:
        text = httpx.get(metrics_url, timeout=2).text
    except httpx.HTTPError:
        return False
    return metric(text, "mooncake:nodes", role="prefill") >= args.prefill and \
        metric(text, "mooncake:nodes", role="decode") >= args.decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["frontend", "bundled", "conductor"], default="frontend",
                    help="the process measured on core 0 (see above)")
    ap.add_argument("--frontends", type=int, default=1, help="--target conductor: stand-in frontends")
    ap.add_argument("--quick", action="store_true", help="two fixed rates and one closed loop, 4 s each, no profile")
    ap.add_argument("--rates", type=float, nargs="+", help="measure these rates instead of searching")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4, 16, 64],
                    help="then closed loops of this many clients each (saturation throughput)")
    ap.add_argument("--start-rate", type=float, default=20.0)
    ap.add_argument("--max-rate", type=float, default=640.0)
    ap.add_argument("--max-steps", type=int, default=9)
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per step")
    ap.add_argument("--grace", type=float, default=5.0, help="seconds to wait for stragglers after the arrivals")
    ap.add_argument("--bound-ms", type=float, default=500.0, help="end-to-end latency bound of a passing request")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--tokens-per-event", type=int, default=1, help="tokens per TokenEvent (a real decode: 1)")
    ap.add_argument("--step-ms", type=float, default=0.0, help="the stand-in decode's step time (0: instant)")
    ap.add_argument("--per-request-events", action="store_true", help="one message per request per decode step")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=len(os.sched_getaffinity(0)) >= 2)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--profile-rate", type=float, help="default: the capacity found")
    args = ap.parse_args()
    if args.quick:
        args.rates, args.duration, args.grace = args.rates or [20.0, 60.0], 4.0, 3.0
        args.concurrency = [16]
    profile = not args.quick if args.profile is None else args.profile
    if args.target == "conductor":
        print(conductor_alone(args), flush=True)
        return 0
    texts = prompts(512)
    t0 = time.perf_counter()
    print(table([]), flush=True)
    rows, closed, capacity = run_search(args, texts)
    print(f"\ncapacity: {capacity if capacity is None else round(capacity, 1)} req/s offered "
          f"(>= {100 * TARGET:.0f}% within {args.bound_ms:.0f} ms end to end; target={args.target}, pin={args.pin}, "
          f"tokens_per_event={args.tokens_per_event}, step_ms={args.step_ms:g}, "
          f"events={'per request' if args.per_request_events else 'per step'}) "
          f"[{time.perf_counter() - t0:.0f} s]\n", flush=True)
    print(table(sorted(rows, key=lambda r: r["rate"]) + closed), flush=True)
    if profile:
        print("\n" + run_profile(args, texts, args.profile_rate or capacity or args.start_rate), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
