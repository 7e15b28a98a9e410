"""``mooncake p2p put|get|ls|rm``: objects shared between the cluster's stores."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from mooncake.config import ConfigError, load_config

CONFIG_HELP = "TOML config file: [conductor] endpoint, [node] name (the store to act through), [security]"


def add_p2p_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("p2p", help="share large objects (model checkpoints) between the cluster's nodes")
    ps = p.add_subparsers(dest="p2p_command", required=True)
    put = ps.add_parser("put", help="publish a file or directory held by this node's store")
    put.add_argument("name")
    put.add_argument("path")
    get = ps.add_parser("get", help="fetch an object into DEST through this node's store (which then serves it)")
    get.add_argument("name")
    get.add_argument("dest", help="directory (created if absent); a directory's files keep their relative paths")
    get.add_argument("--quiet", action="store_true", help="no progress bar")
    get.add_argument("--from", dest="only_from", action="append", metavar="NODE",
                     help="fetch only from this node (repeat for several; default: every holder)")
    ps.add_parser("ls", help="objects, sizes, holders and completeness")
    rm = ps.add_parser("rm", help="remove an object cluster-wide (stores stop serving it; files stay)")
    rm.add_argument("name")
    for sp in (put, get, ps.choices["ls"], rm):
        sp.add_argument("--config", help=CONFIG_HELP)


def run_p2p(args: argparse.Namespace) -> int:
    from mooncake.p2p.client import P2PClient, human
    from mooncake.p2p.rpc import P2PError
    from mooncake.security import CurveError, InsecureNetworkError

    try:
        cfg = load_config(args.config)
        client = P2PClient(cfg)
    except (ConfigError, CurveError, InsecureNetworkError) as e:
        print(f"mooncake p2p: {e}", file=sys.stderr)
        return 2
    bar = ProgressBar(sys.stderr, enabled=not getattr(args, "quiet", False))

    async def run() -> None:
        if args.p2p_command == "put":
            print(await client.put(args.name, args.path))
        elif args.p2p_command == "get":
            t0 = time.monotonic()
            report = await client.get(args.name, args.dest, bar.update, only_from=args.only_from)
            bar.finish()
            dt = time.monotonic() - t0
            peers = ", ".join(f"{k} {human(v)}" for k, v in sorted(report.peers.items())) or "already on disk"
            print(f"fetched {args.name} ({human(report.total_bytes)}) into {args.dest} in {dt:.1f}s; from: {peers}")
        elif args.p2p_command == "ls":
            listing = await client.ls()
            print(f"{'NAME':30} {'VERSION':12} {'SIZE':>10} {'CHUNKS':>6}  HOLDERS (chunks held)")
            for o in listing.objects:
                holders = ", ".join(f"{n} {'complete' if c == o.chunks else f'{c}/{o.chunks}'}"
                                    for n, c in sorted(o.holders.items())) or "none alive"
                print(f"{o.name:30} {o.version[:12]:12} {human(o.total_bytes):>10} {o.chunks:>6}  {holders}")
        else:
            print(await client.rm(args.name))

    try:
        asyncio.run(run())
    except P2PError as e:
        bar.finish()
        print(f"mooncake p2p {args.p2p_command}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


class ProgressBar:
    """One redrawn line on a terminal; nothing when not a terminal (logs stay clean)."""

    def __init__(self, stream, enabled: bool = True, width: int = 30) -> None:
        self.stream = stream
        self.enabled = enabled and stream.isatty()
        self.width = width
        self.t0 = time.monotonic()
        self.drawn = False

    def update(self, report) -> None:
        if not self.enabled or not report.total_bytes:
            return
        from mooncake.p2p.client import human

        frac = report.done_bytes / report.total_bytes
        rate = report.done_bytes / max(time.monotonic() - self.t0, 1e-3)
        filled = int(frac * self.width)
        self.stream.write(f"\r{report.name} [{'#' * filled}{'.' * (self.width - filled)}] {frac:6.1%} "
                          f"{human(report.done_bytes)}/{human(report.total_bytes)} {human(rate)}/s  ")
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
