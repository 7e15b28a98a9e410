"""``mooncake`` command line: serve (one role, or --dev for all) and bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from mooncake.config import ConfigError, load_config


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run one role, or a whole cluster with --dev")
    p.add_argument("--role", choices=["conductor", "prefill", "decode", "store"])
    p.add_argument("--config", help="TOML config file (see config.example.toml)")
    p.add_argument("--dev", action="store_true", help="all roles on this machine, one process each")
    p.add_argument("--model", help="model directory, GGUF file, or Hugging Face repo id (org/name) in the local "
                                   "Hugging Face cache (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: org/name, or the path's name)")
    p.add_argument("--max-model-len", type=int, help="context limit in tokens (default: the model's own)")
    p.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--api-key", help="require this bearer token on /v1/*")
    p.add_argument("--data-dir", help="directory of the stores' LMDB tier")
    p.add_argument("--prefill", type=int, default=1, help="--dev: prefill instances")
    p.add_argument("--decode", type=int, default=1, help="--dev: decode instances")
    p.add_argument("--store", type=int, default=1, help="--dev: store instances")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _overrides(args: argparse.Namespace) -> dict:
    o: dict = {}
    if args.model:
        o.setdefault("model", {})["path"] = args.model
    for key, section, field in (("host", "conductor", "host"), ("port", "conductor", "port"),
                                ("api_key", "conductor", "api_key"), ("data_dir", "store", "data_dir"),
                                ("served_model_name", "model", "name"), ("max_model_len", "engine", "max_model_len")):
        value = getattr(args, key)
        if value is not None:
            o.setdefault(section, {})[field] = value
    return o


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.dev == bool(args.role):
        print("mooncake serve: give exactly one of --dev or --role", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, _overrides(args))
    except ConfigError as e:
        print(f"mooncake: {e}", file=sys.stderr)
        return 2
    if args.dev:
        from mooncake.roles.dev import run_dev

        return run_dev(cfg, args.prefill, args.decode, args.store, args.log_level)
    if args.role == "conductor":
        from mooncake.roles.serve_conductor import run_conductor as main
    elif args.role == "store":
        from mooncake.roles.store import run_store as main
    else:
        from mooncake.roles.decode import DecodeWorker
        from mooncake.roles.prefill import PrefillWorker

        worker_cls = PrefillWorker if args.role == "prefill" else DecodeWorker

        async def main(cfg):  # type: ignore[no-redef]
            await worker_cls(cfg).start()
    from mooncake.engine import ModelLoadError

    try:
        asyncio.run(main(cfg))
    except ModelLoadError as e:
        print(f"mooncake: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    keys = sub.add_parser("keys", help="create the cluster keypair for [security] curve_keys_dir")
    keys.add_argument("dir", help="directory to write cluster.key and cluster.key_secret into")
    from mooncake.bench.cli import add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "keys":
        from mooncake.security import generate_keys

        print(f"wrote {generate_keys(args.dir)}; set [security] curve_keys_dir = \"{args.dir}\" on every role")
        return 0
    from mooncake.bench.cli import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
