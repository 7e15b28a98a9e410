"""Request classes in the simulator: the shared trace with a share of flex requests, at a
multiple of its rate, against the same requests with classes off (issue 32).

A share of the trace's requests (``--flex-share``, drawn with ``--seed``) is sent as
``service_tier: flex``; with classes on, every queue serves interactive requests first and
flex work is never refused for their SLOs (it waits); with classes off (``--no-classes``)
the same requests are all served alike. Per class: requests served, SLO attainment (flex:
served at all), TTFT p50/p90, output tokens served and when the last one was (flex
throughput: its tokens over that time), on the same cluster.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_sim_classes.py \\
        [--rate-scale 4] [--flex-share 0.3] [--prefill 4] [--decode 3] [--ttft-slo-ms 10000] [--tbt-slo-ms 30]
"""

from __future__ import annotations

import argparse

from mooncake.sim.profiles import hardware_for
from mooncake.sim.setup import SimSetup
from mooncake.sim.simulator import simulate
from mooncake.sim.workload import load_requests

TRACE = "/work/shared/traces/synthetic_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--profile", default="a800x8-llama2-70b")
    ap.add_argument("--rate-scale", type=float, default=4.0)
    ap.add_argument("--flex-share", type=float, default=0.3)
    ap.add_argument("--prefill", type=int, default=4)
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--ttft-slo-ms", type=float, default=10000.0)
    ap.add_argument("--tbt-slo-ms", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hw = hardware_for(args.profile, 512)
    requests = load_requests(args.trace, block_tokens=512, rate_scale=args.rate_scale, flex_share=args.flex_share,
                             seed=args.seed)
    print(f"{args.trace.split('/')[-1]} at {args.rate_scale:g}x its rate, {args.flex_share:.0%} flex; "
          f"{args.prefill} prefill + {args.decode} decode, {args.profile}; SLOs TTFT {args.ttft_slo_ms:g} ms, "
          f"TBT {args.tbt_slo_ms:g} ms (interactive only)\n")
    print("| classes | class | requests | served | SLO attainment | TTFT p50 s | TTFT p90 s | output tokens | "
          "last done s |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for on in (True, False):
        setup = SimSetup(args.prefill, args.decode, "cache_aware", True, args.ttft_slo_ms, args.tbt_slo_ms,
                         args.seed, classes=on)
        r = results[on] = simulate(setup, hw, requests)
        for cls_name, c in r.by_class.items():
            print(f"| {'on' if on else 'off'} | {cls_name} | {c['requests']} | {c['completed']} | "
                  f"{c['slo_attainment']:.3f} | {c['ttft_p50_s']:.2f} | {c['ttft_p90_s']:.2f} | "
                  f"{c['output_tokens']} | {c['last_finished_s']:.0f} |")
    on, off = results[True].by_class, results[False].by_class
    rate = {k: v["flex"]["output_tokens"] / max(v["flex"]["last_finished_s"], 1e-9) for k, v in (("on", on), ("off", off))}
    print(f"\ninteractive attainment {on['default']['slo_attainment']:.3f} with classes vs "
          f"{off['default']['slo_attainment']:.3f} without; flex requests served {on['flex']['completed']} vs "
          f"{off['flex']['completed']} of {on['flex']['requests']}, flex output tokens {on['flex']['output_tokens']} vs "
          f"{off['flex']['output_tokens']} ({rate['on']:.0f} vs {rate['off']:.0f} per second until the last)")


if __name__ == "__main__":
    main()
