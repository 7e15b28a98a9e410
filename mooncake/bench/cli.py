"""``mooncake bench`` (run a benchmark) and ``mooncake bench plot`` (figures)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from mooncake.bench.arrivals import ARRIVAL_KINDS, ArrivalSpec
from mooncake.bench.config import BenchConfig
from mooncake.bench.metrics import parse_goodput
from mooncake.bench.prompts import TokenRange
from mooncake.bench.report import format_table
from mooncake.bench.runner import BenchError, run_benchmark
from mooncake.bench.trace import TraceError, TraceScaling
from mooncake.bench.workloads import SharedPrefixSpec


def _add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    g.add_argument("--model", help="model name (default: first from GET /v1/models)")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--prompt-mode", choices=("tokens", "text"), default="tokens",
                   help="tokens: prompt as token ids (exact counts); text: ids rendered as English words")
    g.add_argument("--token-range", default="1000:30000", metavar="LO:HI",
                   help="token ids used in prompts, [LO, HI) (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (output lengths follow the workload)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in s (default: %(default)s)")
    g.add_argument("--tokenizer", help="HF dir or .gguf file: re-encodes answers for multi-turn token prompts")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("trace", "shared-prefix"),
                   help="default: trace when --trace is given, else shared-prefix")
    g.add_argument("--trace", help="Mooncake-format trace (JSON Lines)")
    g.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash block (default: 512)")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace timestamps (0.5: twice as fast)")
    g.add_argument("--max-input-tokens", type=int, help="truncate prompts to this many tokens")
    g.add_argument("--max-output-tokens", type=int, help="cap max_tokens")
    g.add_argument("--max-requests", type=int, help="issue at most this many requests")
    g.add_argument("--duration", type=float, help="stop issuing requests after this many seconds")
    g.add_argument("--prefix-groups", type=int,
                   help="trace: keep only the requests of the N largest prefix groups (keeps sharing in short runs)")
    g.add_argument("--unique-prefixes", action="store_true",
                   help="trace: every request on blocks of its own (the same lengths and arrivals, no reuse)")
    g.add_argument("--groups", type=int, default=4, help="shared-prefix: prefix groups")
    g.add_argument("--sessions-per-group", type=int, default=4, help="shared-prefix: conversations per group")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: shared prefix tokens")
    g.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: unique tokens per turn")
    g.add_argument("--turns", type=int, default=1, help="shared-prefix: turns per conversation")
    g.add_argument("--output-len", type=int, default=32, help="shared-prefix: max_tokens per turn")

    g = p.add_argument_group("arrivals")
    g.add_argument("--arrival", choices=ARRIVAL_KINDS,
                   help="default: trace timestamps for a trace, else a closed loop (concurrency)")
    g.add_argument("--rate", type=float, help="sessions/s for --arrival rate|poisson")
    g.add_argument("--concurrency", type=int,
                   help="requests in flight: the closed loop's size, or a cap for other arrivals (default 4 for concurrency)")
    g.add_argument("--seed", type=int, default=0, help="seed of Poisson arrivals and synthetic prompts")

    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el)")
    g.add_argument("--out", help="write the JSON report here")
    g.add_argument("--label", help="name of this run in plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench_parser(subparsers) -> None:
    """Add ``bench`` (and its ``plot`` sub-action) to an argparse subparsers object."""
    p = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server",
                              description="Load generator for OpenAI-compatible servers (streaming).")
    _add_run_options(p)
    actions = p.add_subparsers(dest="bench_action", metavar="{plot}")
    plot = actions.add_parser("plot", help="PNG figures from JSON reports")
    plot.add_argument("results", nargs="+", help="JSON reports written by 'bench --out'")
    plot.add_argument("--out", required=True, dest="plot_out", metavar="DIR", help="output directory")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Build (and validate) a BenchConfig; raises ValueError on bad options."""
    workload = args.workload or ("trace" if args.trace else "shared-prefix")
    seed = args.seed
    arrival = None
    if args.arrival is not None or args.concurrency is not None or args.rate is not None:
        kind = args.arrival or ("poisson" if args.rate is not None else
                                "concurrency" if workload == "shared-prefix" else "trace")
        concurrency = args.concurrency if args.concurrency is not None or kind != "concurrency" else 4
        arrival = ArrivalSpec(kind=kind, rate=args.rate, concurrency=concurrency, seed=seed)
    return BenchConfig(
        base_url=args.url.rstrip("/"), model=args.model, api_key=args.api_key,
        endpoint=args.endpoint, prompt_mode=args.prompt_mode, temperature=args.temperature,
        ignore_eos=args.ignore_eos, workload=workload, trace_path=args.trace,
        scaling=TraceScaling(block_tokens=args.block_tokens, time_scale=args.time_scale,
                             max_input_tokens=args.max_input_tokens,
                             max_output_tokens=args.max_output_tokens, prefix_groups=args.prefix_groups,
                             unique_prefixes=args.unique_prefixes),
        shared_prefix=SharedPrefixSpec(groups=args.groups, sessions_per_group=args.sessions_per_group,
                                       prefix_tokens=args.prefix_len, suffix_tokens=args.suffix_len,
                                       turns=args.turns, output_tokens=args.output_len, seed=seed),
        token_range=TokenRange.parse(args.token_range), arrival=arrival,
        max_requests=args.max_requests, duration_s=args.duration,
        goodput_slos_ms=parse_goodput(args.goodput), timeout_s=args.timeout,
        tokenizer=args.tokenizer, label=args.label, progress=not args.no_progress)


def run_bench(args: argparse.Namespace) -> int:
    """Run the parsed ``bench`` command. 0: ran (and, for a run, >= 1 request completed);
    1: no request completed; 2: bad options, trace or server."""
    if getattr(args, "bench_action", None) == "plot":
        from mooncake.bench.plot import plot_reports  # matplotlib only when plotting

        try:
            written = plot_reports(args.results, args.plot_out)
        except (OSError, ValueError, KeyError) as exc:
            print(f"mooncake bench plot: {exc}", file=sys.stderr)
            return 2
        for path in written:
            print(path)
        return 0
    try:
        cfg = config_from_args(args)
        report = asyncio.run(run_benchmark(cfg, command=list(sys.argv)))
    except (TraceError, BenchError, ValueError, OSError) as exc:
        print(f"mooncake bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.out:
        report.save(args.out)
        print(f"report written to {args.out}")
    return 0 if report.summary["completed"] else 1
