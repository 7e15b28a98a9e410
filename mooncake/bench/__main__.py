"""``python -m mooncake.bench ...``: the ``mooncake bench`` command without the main CLI."""

from __future__ import annotations

import argparse
import sys

from mooncake.bench.cli import add_bench_parser, run_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
