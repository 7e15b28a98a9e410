"""End to end: mooncake (cache-aware / cache-off / round-robin) vs `transformers serve` and `llama-server`.

Two workloads, each against every system in turn (one system up at a time):

* trace: the Mooncake trace's requests of its 3 largest prefix groups (69
  requests, 95% of their blocks shared; a contiguous slice of a few minutes has
  under 10% reuse: the trace's sharing is long-range), hash blocks expanded to 16
  tokens, prompts truncated to 1,500 tokens, outputs capped at 32, arrivals at
  the trace's timestamps scaled by 0.1;
* shared-prefix: groups of conversations sharing a long system prefix, 2 turns.

Systems (all 2 prefill + 1 decode + 1 store processes, one torch thread each):

* ``cache_aware``: mooncake's default policy, KV store on;
* ``cache_off``: ``conductor.use_store = false`` and ``engine.prefix_caching =
  false``: the same processes, but every prompt is computed in full;
* ``round_robin``: mooncake, ``conductor.policy = round_robin``, store on;
* ``cache_aware_slo``: ``cache_aware`` with the benchmark's SLOs set on the conductor
  (``ttft_slo_ms``, ``tbt_slo_ms``): requests it predicts would miss them are refused early
  (429) instead of queued; off by default, so not among the default systems;
* ``hf_serve``: ``transformers serve --continuous-batching`` on the same
  converted model (text prompts: it does not take token-id prompts);
* ``llama_server``: llama.cpp's ``llama-server`` on the same GGUF file, default settings
  with ``-np 4`` and 2 threads (token-id prompts, ``ignore_eos``). Its binary is built by
  ``make bench``'s set-up (``benchmarks/peers/build_llama_server.sh``); ``--llama-server``
  names another one.

    .venv/bin/python benchmarks/bench_e2e.py [--quick] [--systems ...] [--workloads ...] [--dtype D]
                                             [--rate-scale R | --capacity] [--out RESULTS.md]

``--min-arrival-s S`` (with ``--capacity``) repeats each workload at every rate until its
arrivals span at least S seconds, each repetition on prefixes of its own (see ``workloads``),
so that capacity is a rate sustained for S seconds, not a burst of one replay absorbed
within the SLO; attainment is over the whole replay. Unset: one replay, as before.

``--dtype`` is mooncake's serving dtype (default ``auto``, as ``mooncake serve``: bfloat16
on CPUs with AMX or AVX-512 BF16); ``--rate-scale R`` multiplies both workloads' arrival
rates (the trace's timestamps are divided by R). ``--capacity`` instead searches each
system's capacity, the highest rate scale at which >= 90% of requests meet the SLO
(``benchmarks/e2e_capacity.py``; ``--start-scale``, ``--max-scale``, ``--max-rates``, ``--bisect-steps``).

JSON reports go to --json-dir (default /tmp/mooncake-e2e).
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
from pathlib import Path

import httpx

from mooncake.bench import (ArrivalSpec, BenchConfig, SharedPrefixSpec, TraceScaling,
                            run_benchmark)
from mooncake.bench.arrivals import copies_to_span
from mooncake.bench.publish import publish
from mooncake.config import Config, ConductorConfig, MiB, ModelConfig
from mooncake.local.machine_cluster import LocalCluster
from mooncake.engine.loading.loader import default_model_path, resolve_model_dir
from mooncake.testing.cluster import small_config
from mooncake.testing.ports import free_port

TRACE = str(Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl")  # ../shared beside the checkout
SLOS = {"ttft": 3000.0, "tpot": 300.0}
SYSTEMS = ["cache_aware", "cache_off", "round_robin", "hf_serve", "llama_server"]
OPTIONAL_SYSTEMS = ["cache_aware_slo", "colocated", "pair", "colocated_slo", "pair_slo"]  # run only when named
WORKLOADS = ["trace", "shared-prefix"]
LLAMA_SERVER = Path(__file__).resolve().parent.parent / ".bench" / "llama" / "build" / "bin" / "llama-server"


def start_mooncake(system: str, dtype: str = "auto", quantization: str = "auto") -> LocalCluster:
    if system.startswith(("colocated", "pair")):  # `mooncake serve` (--colocated 1), or --disaggregated
        cfg = Config()
        cfg.model.dtype, cfg.model.quantization, cfg.frontend.port = dtype, quantization, free_port()
        cfg.store.data_dir = tempfile.mkdtemp(prefix="mooncake-e2e-")
        if system.endswith("_slo"):  # the benchmark's SLOs set on the conductor
            cfg.admission.ttft_slo_ms, cfg.admission.tbt_slo_ms = SLOS["ttft"], SLOS["tpot"]
        colocated = system.startswith("colocated")
        return start_local(cfg, **({"prefill": 0, "decode": 0, "colocated": 1} if colocated else {"prefill": 1}))
    cfg = small_config(Path(tempfile.mkdtemp(prefix="mooncake-e2e-")))
    cfg.model.dtype = dtype  # small_config pins float32 for the exactness tests
    cfg.conductor.store_writes = ConductorConfig().store_writes  # ... and writes every block: serve's default here
    cfg.engine.kv_cache_bytes = 400 * MiB  # ~8,900 tokens per instance
    if system == "cache_off":
        cfg.conductor.use_store = False
        cfg.engine.prefix_caching = False
    if system == "round_robin":
        cfg.conductor.policy = "round_robin"
    if system == "cache_aware_slo":
        cfg.admission.ttft_slo_ms, cfg.admission.tbt_slo_ms = SLOS["ttft"], SLOS["tpot"]
    return start_local(cfg)


def start_local(cfg, prefill: int = 2, decode: int = 1, colocated: int = 0) -> LocalCluster:
    """The benchmark's mooncake cluster on ``cfg`` (by default 2 prefill, 1 decode, 1 store processes), started."""
    cluster = LocalCluster(cfg, prefill=prefill, decode=decode, store=1, colocated=colocated)
    try:
        cluster.start(timeout_s=300)
    except BaseException:
        cluster.stop()
        raise
    return cluster


class PeerServer:
    """A peer system's server process (its own session), up once ``/health`` answers 200."""

    name = "peer"

    def __init__(self, cmd: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)

    def start(self, timeout_s: float = 300) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="2")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                   f"{Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not become healthy")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


class HFServe(PeerServer):
    name = "transformers-serve"

    def __init__(self, model_dir: str, port: int) -> None:
        exe = Path(sys.executable).with_name("transformers")
        super().__init__([str(exe), "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32",
                          "--port", str(port), model_dir], port)


class LlamaServer(PeerServer):
    name = "llama-server"

    def __init__(self, binary: Path, gguf: Path, port: int) -> None:
        if not binary.is_file():
            raise RuntimeError(f"no llama-server at {binary}: run `make bench-setup` "
                               "(benchmarks/peers/build_llama_server.sh) or pass --llama-server")
        super().__init__([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                          "-t", "2", "-np", "4"], port)


def workloads(quick: bool, model_dir: str, rate_scale: float = 1.0, salt: int = 0,
              min_arrival_s: float | None = None, full_output: bool = False) -> dict[str, dict]:
    """BenchConfig arguments of both workloads; ``salt`` != 0 draws other prompt tokens (same
    sharing structure), so that a replay finds nothing cached by an earlier one.

    ``min_arrival_s``: at this rate, repeat each workload until its arrivals span at least
    this long (a sustained rate, not one burst): the trace's selection repetition after
    repetition at its own mean rate, each on hash ids of its own; shared-prefix: copies of
    its conversations, each copy on groups (prefixes) of its own, on the same Poisson
    process. Within a repetition the sharing is the workload's; across repetitions none.
    ``full_output``: the trace's requests run to their own output lengths (else at most 32 tokens)."""
    n_trace = 24 if quick else 69
    scaling = TraceScaling(block_tokens=16, time_scale=0.1 / rate_scale, max_input_tokens=1500,
                           max_output_tokens=None if full_output else 32, max_requests=n_trace, prefix_groups=3, salt=salt,
                           min_span_s=min_arrival_s)
    # the selection is bounded by scaling.max_requests; a repetition must not be cut by the runner's cap
    trace = dict(workload="trace", trace_path=TRACE, max_requests=None if min_arrival_s else n_trace,
                 scaling=scaling)
    arrival = ArrivalSpec(kind="poisson", rate=1.0 * rate_scale, seed=0)
    groups, per_group = (2, 2) if quick else (3, 4)
    copies = copies_to_span(arrival, groups * per_group, min_arrival_s) if min_arrival_s else 1
    sp = SharedPrefixSpec(groups=groups, sessions_per_group=per_group, prefix_tokens=1024, suffix_tokens=32,
                          turns=2, output_tokens=16, seed=salt, repeats=copies)
    shared = dict(workload="shared-prefix", shared_prefix=sp, tokenizer=model_dir, arrival=arrival)
    return {"trace": trace, "shared-prefix": shared}


async def warm(url: str, model: str | None, text: bool) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        if not model:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello there" if text else [1000, 1001, 1002], "max_tokens": 2}
        r = await c.post("/v1/completions", json=body)
        r.raise_for_status()


def start_system(system: str, model_dir: str, dtype: str = "auto",
                 llama_server: Path = LLAMA_SERVER) -> tuple[PeerServer | LocalCluster, dict]:
    """Start ``system`` and send it one warm-up request; returns the server (the caller stops
    it) and the BenchConfig arguments that point at it."""
    t0 = time.perf_counter()
    server: PeerServer | LocalCluster
    if system == "hf_serve":
        server = HFServe(model_dir, free_port())
        server.start()
        target = {"base_url": server.url, "prompt_mode": "text", "model": model_dir}
    elif system == "llama_server":
        server = LlamaServer(llama_server, default_model_path(), free_port())
        server.start()
        target = {"base_url": server.url, "ignore_eos": True}
    else:
        server = start_mooncake(system, dtype)
        target = {"base_url": server.url, "ignore_eos": True}
    print(f"[{system}] up in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        asyncio.run(warm(target["base_url"], target.get("model"), system == "hf_serve"))
    except BaseException:
        server.stop()
        raise
    return server, target


def run_workload(system: str, name: str, kw: dict, target: dict, json_dir: Path, tag: str = "") -> dict:
    """One replay of workload ``name`` against a started system; prints and returns its summary."""
    kw = dict(kw)
    if target.get("prompt_mode") == "text":
        kw.pop("tokenizer", None)  # text prompts: the answers are appended as text
    cfg = BenchConfig(goodput_slos_ms=SLOS, label=f"{system}/{name}{tag}", progress=False, timeout_s=300,
                      **kw, **target)
    t1 = time.perf_counter()
    report = asyncio.run(run_benchmark(cfg))
    path = json_dir / f"{system}-{name}{tag}.json"
    report.save(path)
    s = report.summary
    itl = s.get("itl_ms") or {}
    print(f"[{system}/{name}{tag}] {s['completed']}/{s['requests']} ok, {s['good_requests']} in SLO, "
          f"goodput {s['goodput']:.3f} req/s, throughput {s['request_throughput']:.3f} req/s, "
          f"TPOT p99 {(s['tpot_ms'] or {}).get('p99')} ms, "
          f"hit {s['prefix_hit_rate']}, ttft p50 {s['ttft_ms']['median']} ms, tpot p50 {s['tpot_ms']['median']} ms, "
          f"itl p50/p99 {itl.get('median')}/{itl.get('p99')} ms ({time.perf_counter() - t1:.0f} s) -> {path}",
          flush=True)
    return s


def run_system(system: str, wl: dict[str, dict], json_dir: Path, model_dir: str,
               dtype: str = "auto", llama_server: Path = LLAMA_SERVER) -> dict[str, dict]:
    server, target = start_system(system, model_dir, dtype, llama_server)
    try:
        return {name: run_workload(system, name, kw, target, json_dir) for name, kw in wl.items()}
    finally:
        server.stop()


def fmt(x, d=2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def table(results: dict[str, dict[str, dict]], wl_name: str) -> str:
    rows = ["| system | ok / total | goodput (req/s) | throughput (req/s) | TTFT p50 (ms) | TPOT p50 (ms) | "
            "ITL p50 / p99 (ms) | prefix hit rate | goodput vs llama_server | vs hf_serve | vs cache_off |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {k: (v.get(wl_name) or {}).get("goodput") for k, v in results.items()}
    for system, per in results.items():
        s = per.get(wl_name)
        if s is None:
            rows.append(f"| {system} | failed / not run | | | | | | | | | |")
            continue
        ratio = lambda ref: (fmt(s["goodput"] / ref) + "x") if ref else "-"  # noqa: E731
        itl = s.get("itl_ms") or {}
        rows.append(f"| {system} | {s['completed']} / {s['requests']} | {fmt(s['goodput'], 3)} | "
                    f"{fmt(s['request_throughput'], 3)} | {fmt(s['ttft_ms']['median'], 0)} | "
                    f"{fmt(s['tpot_ms']['median'], 0)} | {fmt(itl.get('median'), 0)} / {fmt(itl.get('p99'), 0)} | "
                    f"{fmt(s['prefix_hit_rate'], 3)} | {ratio(base.get('llama_server'))} | "
                    f"{ratio(base.get('hf_serve'))} | {ratio(base.get('cache_off'))} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (24 trace requests, 2x2x2 sessions)")
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS + OPTIONAL_SYSTEMS)
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    ap.add_argument("--json-dir", default="/tmp/mooncake-e2e")
    ap.add_argument("--out", help="also write the markdown tables here")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="mooncake's dtype")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rates by this")
    ap.add_argument("--full-output", action="store_true",
                    help="the trace's requests run to their own output lengths (default: at most 32 tokens)")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="the llama-server binary")
    cap = ap.add_argument_group("capacity search (--capacity; rates in multiples of the workload's own)")
    cap.add_argument("--capacity", action="store_true", help="search each system's capacity (e2e_capacity.py)")
    cap.add_argument("--start-scale", type=float, default=1.0, help="first rate scale tried")
    cap.add_argument("--max-scale", type=float, default=16.0, help="highest rate scale tried")
    cap.add_argument("--min-scale", type=float, default=0.25, help="lowest rate scale tried (when 1x fails)")
    cap.add_argument("--max-rates", type=int, default=8, help="rates searched per system and workload")
    cap.add_argument("--bisect-steps", type=int, default=2)
    cap.add_argument("--min-arrival-s", type=float, default=None,
                     help="at every rate, repeat the workload (fresh prefixes per repetition) until its "
                          "arrivals span at least this many seconds: capacity at a sustained rate, not a burst")
    cap.add_argument("--report-scales", type=float, nargs="*", default=[1.0, 2.0, 4.0],
                     help="also measured after the search if not tried (goodput at these rates)")
    args = ap.parse_args()
    json_dir = Path(args.json_dir)
    json_dir.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model_dir(ModelConfig(dtype="float32"))[0])  # transformers serve runs float32
    if args.capacity:
        from e2e_capacity import run_capacity
        out, results, failed = run_capacity(args, model_dir, json_dir)
    else:
        every = workloads(args.quick, model_dir, args.rate_scale, min_arrival_s=args.min_arrival_s,
                          full_output=args.full_output)
        wl = {k: v for k, v in every.items() if k in args.workloads}
        results, failed = {}, []
        for system in args.systems:
            try:
                results[system] = run_system(system, wl, json_dir, model_dir, args.dtype, args.llama_server)
            except Exception as exc:  # report the others; exit non-zero at the end
                print(f"[{system}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                results[system] = {}
                failed.append(system)
        text = [f"SLOs for goodput: TTFT <= {SLOS['ttft']:.0f} ms and TPOT <= {SLOS['tpot']:.0f} ms; mooncake dtype "
                f"{args.dtype}; arrival rates x{args.rate_scale:g}."]
        for name in wl:
            text += ["", f"### {name}", "", table(results, name)]
        out = "\n".join(text)
    publish(out, args.out)
    (json_dir / ("capacity.json" if args.capacity else "summary.json")).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
