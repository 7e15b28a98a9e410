"""``mooncake`` command line: serve (the whole cluster on this machine, or one role), keys, bench, sim, p2p, config
check, probe (an exec health probe) and deploy kubernetes."""

from __future__ import annotations

import argparse
import gc
import sys

import uvloop

from mooncake.config import ConfigError, load_config
from mooncake.logs import setup_logging, tag_logs


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model: the whole cluster on this machine, or one role of a cluster "
                                     "with --role")
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="model directory, GGUF file, or Hugging Face repo id (as --model)")
    p.add_argument("--role", choices=["conductor", "frontend", "prefill", "decode", "colocated", "store"],
                   help="run this one role (default: every role on this machine, one process each)")
    p.add_argument("--config", help="TOML config file (see config.example.toml); MOONCAKE_<SECTION>_<KEY> "
                                    "environment variables apply over it, or alone without it")
    p.add_argument("--dev", action="store_true", help="every role on this machine (the default without --role)")
    p.add_argument("--model", help="model directory, GGUF file, or Hugging Face repo id (org/name) in the local "
                                   "Hugging Face cache (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: org/name, or the path's name)")
    p.add_argument("--max-model-len", type=int, help="context limit in tokens (default: the model's own)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="serving dtype (default auto: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16)")
    p.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8000)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require this bearer token on /v1/*, /cluster and /metrics (repeat the option, or "
                        "separate keys with commas, to accept several: the first becomes [frontend] api_key, "
                        "the rest api_keys)")
    p.add_argument("--data-dir", help="directory of the stores' LMDB tier")
    p.add_argument("--colocated", type=int,
                   help="single machine: colocated instances, each prefilling and decoding in one engine (default 1, "
                        "unless --prefill/--decode/--disaggregated ask for a prefill/decode pair)")
    p.add_argument("--prefill", type=int, help="single machine: prefill instances (a disaggregated cluster)")
    p.add_argument("--decode", type=int, help="single machine: decode instances (a disaggregated cluster)")
    p.add_argument("--disaggregated", action="store_true", help="single machine: --prefill 1 --decode 1")
    p.add_argument("--store", type=int, default=1, help="single machine: store instances")
    p.add_argument("--frontends", type=int, default=1,
                   help="single machine: frontends serving the API on --port, --port+1, ... (one: in the "
                        "conductor's process)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _overrides(args: argparse.Namespace) -> dict:
    o: dict = {}
    if args.model:
        o.setdefault("model", {})["path"] = args.model
    if args.api_key:
        keys = [k.strip() for arg in args.api_key for k in arg.split(",") if k.strip()]
        o.setdefault("frontend", {}).update(api_key=keys[0] if keys else "", api_keys=keys[1:])
    for key, section, field in (("host", "frontend", "host"), ("port", "frontend", "port"),
                                ("data_dir", "store", "data_dir"),
                                ("served_model_name", "model", "name"), ("dtype", "model", "dtype"), ("max_model_len", "engine", "max_model_len")):
        value = getattr(args, key, None)
        if value is not None:
            o.setdefault(section, {})[field] = value
    return o


def serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.dev and args.role:
        print("mooncake serve: --dev runs every role; give --role or --dev, not both", file=sys.stderr)
        return 2
    if args.model_arg and args.model and args.model_arg != args.model:
        print(f"mooncake serve: two models given ({args.model_arg} and --model {args.model})", file=sys.stderr)
        return 2
    args.model = args.model or args.model_arg
    try:
        cfg = load_config(args.config, _overrides(args))
    except ConfigError as e:
        print(f"mooncake: {e}", file=sys.stderr)
        return 2
    if not args.role:
        from mooncake.local.machine_cluster import run_local

        # One colocated instance by default (it served the trace replays better here: BENCHMARKS.md
        # section 24); a disaggregated pair when any of --prefill, --decode, --disaggregated is given.
        pair = int(args.disaggregated or args.prefill is not None or args.decode is not None)
        colocated = (0 if pair else 1) if args.colocated is None else args.colocated
        prefill = pair if args.prefill is None else args.prefill
        decode = pair if args.decode is None else args.decode
        if not colocated and not (prefill and decode):
            print("mooncake serve: the cluster needs a prefill and a decode instance, or --colocated", file=sys.stderr)
            return 2
        return run_local(cfg, prefill, decode, args.store, args.log_level, args.frontends, colocated)
    tag_logs(args.role, cfg.node.node_id or cfg.node.name)
    from mooncake.roles.cpu_priority import apply_role_priority

    apply_role_priority(args.role, cfg.node.prefill_nice)  # before the engine starts any thread
    if args.role == "conductor":
        from mooncake.roles.conductor import run_conductor as main
    elif args.role == "frontend":
        from mooncake.roles.frontend import run_frontend as main
    elif args.role == "store":
        from mooncake.roles.store import run_store as main
    else:
        from mooncake.roles.colocated import ColocatedWorker
        from mooncake.roles.decode import DecodeWorker
        from mooncake.roles.prefill import PrefillWorker

        worker_cls = {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}[args.role]

        async def main(cfg):  # type: ignore[no-redef]
            await worker_cls(cfg).start()
    from mooncake.engine import ModelLoadError
    from mooncake.roles.conductor_link import HandshakeError
    from mooncake.p2p.rpc import P2PError
    from mooncake.security import CurveError, InsecureNetworkError

    # What start-up imported (torch's modules alone are ~200,000 objects) stays for the process's
    # life: out of the collector's generations, a full collection no longer walks it — a pause of
    # ≈100 ms of every thread (the GIL) on this machine, now well under 1 ms at start.
    gc.freeze()
    try:
        uvloop.run(main(cfg))  # libuv's event loop: every role's messages cost less loop overhead than on asyncio's
    except (ModelLoadError, InsecureNetworkError, CurveError, HandshakeError, P2PError) as e:
        print(f"mooncake: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def _ops_parsers(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="print the effective config (file + MOONCAKE_* environment) or its errors")
    check.add_argument("file", nargs="?", help="TOML config file (omit: defaults + environment only)")
    probe = sub.add_parser("probe", help="exec health probe of a role: exit 0 when healthy, 1 when not")
    probe.add_argument("--role", required=True, choices=["conductor", "frontend", "prefill", "decode", "colocated", "store"])
    probe.add_argument("--config", help="TOML config file (the environment applies over it)")
    probe.add_argument("--check", default="ready", choices=["live", "ready"])
    deploy = sub.add_parser("deploy", help="render deployment manifests from a config")
    deploy_sub = deploy.add_subparsers(dest="target", required=True)
    k8s = deploy_sub.add_parser("kubernetes", help="write Kubernetes manifests (*.yaml) into --out")
    k8s.add_argument("--config", help="TOML config file of the cluster (the environment applies over it)")
    k8s.add_argument("--out", required=True, help="directory to write the manifests into")
    k8s.add_argument("--image", default="mooncake:latest", help="container image (see deploy/Dockerfile)")
    k8s.add_argument("--namespace", default="mooncake")
    for role in ("prefill", "decode"):
        k8s.add_argument(f"--{role}", type=int, help=f"{role} replicas (default 1; 0 with --colocated)")
    k8s.add_argument("--store", type=int, default=1, help="store replicas")
    k8s.add_argument("--colocated", type=int, default=0, help="colocated replicas (prefill and decode in one engine)")
    k8s.add_argument("--frontend", type=int, default=2, help="frontend replicas (the OpenAI API, behind one Service)")
    k8s.add_argument("--conductor", type=int, default=2,
                     help="conductor replicas: more than one fail over through etcd ([coordination] etcd_endpoints, "
                          "or an etcd rendered with them)")


def run_ops(args: argparse.Namespace) -> int:
    """config check, probe and deploy: each loads the config the same way serve does."""
    try:
        cfg = load_config(args.file if args.command == "config" else args.config)
    except ConfigError as e:
        print(f"mooncake: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        from mooncake.config_toml import dump_toml

        print(dump_toml(cfg, mask_secrets=True), end="")
        return 0
    if args.command == "probe":
        from mooncake.roles.node_health import probe

        try:
            ok, said = probe(cfg, args.role, args.check)
        except ValueError as e:
            print(f"mooncake probe: {e}", file=sys.stderr)
            return 2
        print(said, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    from mooncake.deploy.kubernetes import DeployError, Topology, write_manifests

    try:
        pair = 0 if args.colocated else 1
        topology = Topology(image=args.image, namespace=args.namespace,
                            prefill=pair if args.prefill is None else args.prefill,
                            decode=pair if args.decode is None else args.decode, store=args.store,
                            colocated=args.colocated, frontend=args.frontend, conductor=args.conductor)
        written = write_manifests(cfg, topology, args.out)
    except DeployError as e:
        print(f"mooncake deploy: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def package_version() -> str:
    """The installed distribution's version (the source tree's, where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mooncake")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mooncake {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    from mooncake.p2p.cli import add_p2p_parser, run_p2p

    add_p2p_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["p2p"]:  # before the other commands' parsers: `mooncake p2p` never imports torch
        return run_p2p(parser.parse_args(argv))
    _serve_parser(sub)
    keys = sub.add_parser("keys", help="create the role keys for [security] curve_keys_dir")
    keys.add_argument("dir", help="directory to write KIND.key and KIND.key_secret into (KIND: conductor, "
                                  "worker, store, frontend)")
    keys.add_argument("--frontend", action="append", default=[], metavar="NAME",
                      help="a key of its own for the frontend whose node id is NAME (frontend-NAME.key*), "
                           "instead of the one frontend.key pair; repeat for each frontend")
    keys.add_argument("--frontends-only", action="store_true",
                      help="write only the frontend keys (add frontends to a directory whose other keys stay)")
    from mooncake.bench.cli import add_bench_parser

    add_bench_parser(sub)
    _ops_parsers(sub)
    from mooncake.sim.cli import add_sim_parser

    add_sim_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("config", "probe", "deploy"):
        return run_ops(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "keys":
        from mooncake.security import generate_keys

        from mooncake.security import CurveError

        try:
            written = generate_keys(args.dir, args.frontend, args.frontends_only)
        except CurveError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for secret in written:
            print(f"wrote {secret} and {secret.with_suffix('.key')}")
        print(f"every machine needs all the *.key files and the *.key_secret of the roles it runs (conductor; "
              f"worker: prefill and decode; store; a frontend its own frontend*.key_secret, never the "
              f"conductor's); set [security] curve_keys_dir = \"{args.dir}\"")
        return 0
    if args.command == "sim":
        from mooncake.sim.cli import run_sim

        return run_sim(args)
    from mooncake.bench.cli import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
