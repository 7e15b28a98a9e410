"""``mooncake sim run`` (one simulated cluster: prefill/decode pairs, colocated instances or
both) and ``mooncake sim size`` (the smallest one that meets the SLOs, disaggregated and
colocated), over a Mooncake-format trace."""

from __future__ import annotations

import argparse
import json
import sys

from mooncake.sim.setup import POLICIES

_FIELDS = ("requests", "rejected", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p90_s",
           "slo_attainment", "goodput_rps", "cache_hit_rate", "store_write_share", "sim_wall_s")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake-format trace (JSON Lines)")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash block (default: 512)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="prefill selection (default: %(default)s)")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--no-store", dest="store", action="store_const", const="off", default="auto",
                       help="no store pool: instances reuse only their own device cache (the paper's local "
                            "cache-aware)")
    store.add_argument("--store", dest="store", choices=["auto", "on", "off"], default="auto",
                       help="the shared store pool; auto (default): on for cache_aware, off for the cache-oblivious "
                            "policies, as in the paper's comparison, where only global cache-aware scheduling draws "
                            "on the pool")
    p.add_argument("--store-writes", choices=["reused", "all"], default="reused",
                   help="which blocks go to the stores: reused, a block on its second sighting (default), or all "
                        "([conductor] store_writes)")
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--profile", help="built-in hardware profile (default: a800x8-llama2-70b; see 'sim profiles')")
    hw.add_argument("--calibrate", metavar="URL", help="cost models of a running cluster, from URL/cluster")
    p.add_argument("--api-key", help="--calibrate: the cluster's API key")
    p.add_argument("--kv-codec", choices=["none", "int8", "fp8"], default="none",
                   help="--profile: how KV travels and is stored ([model] kv_codec); a calibrated cluster's "
                        "own is read from its block sizes")
    p.add_argument("--ttft-slo-ms", type=float, default=0.0, help="TTFT SLO (also early rejection); 0: none")
    p.add_argument("--tbt-slo-ms", type=float, default=0.0, help="time-between-tokens SLO; 0: none")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace timestamps")
    p.add_argument("--rate-scale", type=float, default=1.0, help="compresses arrivals: 2 = twice the request rate")
    p.add_argument("--reuse-scale", type=float, default=1.0,
                   help="keep this fraction of each request's shared prefix blocks, fresh blocks after (default: 1)")
    p.add_argument("--output-scale", type=float, default=1.0,
                   help="multiplies every request's output length (at least one token; default: 1)")
    p.add_argument("--step-tokens", type=int, default=0,
                   help="a colocated instance's tokens per step (decode rows and prompt chunks); 0 (default): "
                        "as a calibrated cluster runs it, else as the live role picks it from --tbt-slo-ms ('sim "
                        "size': that and the powers of two from 64, the best)")
    p.add_argument("--max-requests", type=int, help="replay only the first N requests")
    p.add_argument("--flex-share", type=float, default=0.0,
                   help="fraction of the requests, drawn with --seed, sent as service_tier flex (default: 0); a "
                        "trace line with a service_tier field keeps its own")
    p.add_argument("--no-classes", dest="classes", action="store_false",
                   help="serve every request as default, whatever its class (the baseline for --flex-share)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the result as JSON")


def add_sim_parser(subparsers) -> None:
    p = subparsers.add_parser("sim", help="simulate a cluster over a trace with the real scheduler",
                              description=__doc__)
    actions = p.add_subparsers(dest="sim_action", required=True)
    run = actions.add_parser("run", help="simulate one cluster size")
    _common(run)
    run.add_argument("--prefill", type=int, default=0, help="prefill instances (default: 0)")
    run.add_argument("--decode", type=int, default=0, help="decode instances (default: 0)")
    run.add_argument("--colocated", type=int, default=0,
                     help="colocated instances (prefill and decode in one engine; default: 0); a cluster needs "
                          "some, or both --prefill and --decode")
    size = actions.add_parser("size", help="the smallest cluster meeting the SLO attainment")
    _common(size)
    size.add_argument("--attainment", type=float, default=0.9, help="target fraction meeting both SLOs")
    size.add_argument("--max-prefill", type=int, default=64, help="search bound (default: %(default)s)")
    size.add_argument("--max-decode", type=int, default=64, help="search bound (default: %(default)s)")
    size.add_argument("--max-colocated", type=int, default=64,
                      help="search bound of the colocated design (default: %(default)s; 0: size only disaggregated)")
    size.add_argument("--plot", metavar="PNG", help="draw the frontier and both designs")
    actions.add_parser("profiles", help="list the built-in hardware profiles")


def _hardware(args: argparse.Namespace):
    if args.calibrate:
        from mooncake.sim.calibrate import calibrated_hardware, fetch_cluster

        return calibrated_hardware(fetch_cluster(args.calibrate, args.api_key), args.block_tokens,
                                   name=f"calibrated:{args.calibrate}")
    from mooncake.sim.profiles import hardware_for

    return hardware_for(args.profile or "a800x8-llama2-70b", args.block_tokens, args.kv_codec)


def _print_result(r) -> None:
    sizes = [f"{r.prefill} prefill + {r.decode} decode"] if r.prefill else []
    if r.colocated:
        sizes.append(f"{r.colocated} colocated ({r.step_tokens} tokens per step)")
    print(f"{r.policy}{' (no store)' if not r.use_store else ''}, {' + '.join(sizes)}, {r.profile}")
    for k in _FIELDS:
        v = getattr(r, k)
        print(f"  {k:16s} {v:.4g}" if isinstance(v, float) else f"  {k:16s} {v}")
    for cls_name, c in r.by_class.items():
        print(f"  {cls_name}: {c['completed']}/{c['requests']} served, attainment {c['slo_attainment']:.3f}, "
              f"TTFT p90 {c['ttft_p90_s']:.3g} s, {c['output_tokens']} output tokens, the last at {c['last_finished_s']:.4g} s")


def run_sim(args: argparse.Namespace) -> int:
    """0: simulated; 2: bad options, trace, profile or calibration source."""
    from mooncake.bench.trace import TraceError
    from mooncake.sim.calibrate import CalibrationError
    from mooncake.sim.profiles import PROFILES

    if args.sim_action == "profiles":
        for p in PROFILES.values():
            print(f"{p.name:20s} {p.description}")
        return 0
    from mooncake.sim.setup import SimSetup
    from mooncake.sim.simulator import simulate
    from mooncake.sim.workload import load_requests

    try:
        if args.max_requests is not None and args.max_requests < 1:
            raise ValueError("--max-requests must be >= 1")
        hw = _hardware(args)
        requests = load_requests(args.trace, block_tokens=args.block_tokens, rate_scale=args.rate_scale,
                                 time_scale=args.time_scale, reuse_scale=args.reuse_scale,
                                 max_requests=args.max_requests, flex_share=args.flex_share, seed=args.seed,
                                 output_scale=args.output_scale)
        if args.sim_action == "run":
            setup = SimSetup(args.prefill, args.decode, args.policy, _use_store(args), args.ttft_slo_ms,
                             args.tbt_slo_ms, args.seed, args.classes, args.store_writes, args.colocated,
                             args.step_tokens)
            result = simulate(setup, hw, requests)
            _print_result(result)
            out = result.to_dict()
        else:
            out = _size(args, hw, requests)
    except FileNotFoundError as e:
        print(f"mooncake sim: no such file: {e.filename}", file=sys.stderr)
        return 2
    except (TraceError, CalibrationError, ValueError) as e:
        print(f"mooncake sim: {e}", file=sys.stderr)
        return 2
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
    return 0


def _use_store(args: argparse.Namespace) -> bool:
    return args.store == "on" or (args.store == "auto" and args.policy == "cache_aware")


def _size(args: argparse.Namespace, hw, requests) -> dict:
    from mooncake.sim.setup import SimSetup
    from mooncake.sim.size import size_cluster

    if not args.ttft_slo_ms and not args.tbt_slo_ms:
        raise ValueError("sim size needs an SLO: give --ttft-slo-ms and/or --tbt-slo-ms")
    template = SimSetup(1, 1, args.policy, _use_store(args), args.ttft_slo_ms, args.tbt_slo_ms, args.seed,
                        args.classes, args.store_writes, step_tokens=args.step_tokens)
    print(f"{'prefill':>7} {'decode':>6} {'colocated':>9} {'attain':>7} {'ttft_p90':>9} {'tbt_p90':>8} {'rejected':>8} "
          f"{'wall_s':>7}")

    def show(r) -> None:
        print(f"{r.prefill:7d} {r.decode:6d} {r.colocated:9d} {r.slo_attainment:7.3f} {r.ttft_p90_s:9.3f} "
              f"{r.tbt_p90_s:8.4f} {r.rejected:8d} {r.sim_wall_s:7.2f}", flush=True)

    answer = size_cluster(requests, hw, template, args.attainment, args.max_prefill, args.max_decode,
                          progress=show, full_frontier=bool(args.plot), max_colocated=args.max_colocated)
    slo = f"TTFT {args.ttft_slo_ms:g} ms, TBT {args.tbt_slo_ms:g} ms"
    if answer.best is None:
        print(f"no cluster up to {args.max_prefill} prefill + {args.max_decode} decode instances reaches "
              f"{args.attainment:g} SLO attainment ({slo}); raise --max-prefill/--max-decode or relax the SLOs")
    else:
        p, d = answer.best
        r = answer.evaluated[answer.best]
        print(f"smallest cluster: {p} prefill + {d} decode ({p + d} instances): attainment "
              f"{r.slo_attainment:.3f} >= {args.attainment:g} ({slo}, {args.policy}, {hw.name})")
        print("frontier (prefill: fewest decode): " + ", ".join(f"{fp}: {fd}" for fp, fd in answer.frontier))
    if args.max_colocated:
        n = answer.colocated
        if n is None:
            print(f"no colocated cluster up to {args.max_colocated} instances reaches {args.attainment:g} SLO "
                  f"attainment ({slo})")
        else:
            r = answer.colocated_evaluated[(n, answer.colocated_step_tokens)]
            print(f"smallest colocated cluster: {n} colocated ({r.step_tokens} tokens per step): attainment "
                  f"{r.slo_attainment:.3f} >= {args.attainment:g}")
        print(f"designs: {answer.verdict()}")
    if args.plot:
        from mooncake.sim.plot import plot_frontier

        plot_frontier(answer, args.plot, f"{args.trace.split('/')[-1]}: {slo}, attainment >= {args.attainment:g}, "
                      f"{args.policy}, {hw.name}")
        print(f"wrote {args.plot}")
    return answer.to_dict()
