"""The conductor role's process: the Conductor, and (``[conductor] frontend``: by default, unless
under ``[coordination]``) a frontend in the same process serving the OpenAI API — the same code
as ``--role frontend``, talking to the conductor over its socket. Without it, the process
answers the health probes and ``/metrics`` on ``[node] health_port`` (if set).

Under ``[coordination]`` the conductor first campaigns through etcd and stands by until it
leads (its socket unbound meanwhile); a leader whose etcd lease lapses steps down: it drops
what it held and exits non-zero (its supervisor starts it again, as a candidate).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys

from mooncake.conductor import Conductor
from mooncake.conductor.expected_model import expected_model
from mooncake.config import Config
from mooncake.coordination.election import Candidate
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.metrics import Metrics
from mooncake.roles.frontend import load_frontend, serve_http
from mooncake.roles.node_health import start_node_health
from mooncake.security import check_network, role_endpoints

log = logging.getLogger(__name__)


def advertised(endpoint: str, host: str) -> str:
    """``endpoint`` as others reach it: a wildcard bind address becomes ``[node] host``."""
    for wildcard in ("0.0.0.0", "*", "[::]"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


async def run_conductor(cfg: Config) -> None:
    check_network("conductor", role_endpoints(cfg, "conductor"), cfg.security.curve_keys_dir,
                  cfg.security.allow_insecure_network)
    _, name = resolve_model_dir(cfg.model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = Metrics(name)
    serves_frontend = cfg.conductor.serves_frontend(bool(cfg.coordination.etcd_endpoints))
    frontend = load_frontend(cfg, metrics, f"{cfg.node.name}-frontend-{os.getpid()}") if serves_frontend \
        else None
    health = None if frontend else await start_node_health(cfg, "conductor", cfg.node.name, metrics.render)
    candidate = None
    if cfg.coordination.etcd_endpoints:
        candidate = Candidate(cfg.coordination, cfg.node.name, advertised(cfg.conductor.endpoint, cfg.node.host))
        log.info("conductor %s stands by: campaigning through etcd %s", cfg.node.name,
                 ",".join(cfg.coordination.etcd_endpoints))
        campaign = asyncio.create_task(candidate.win())
        await asyncio.wait({campaign, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if not campaign.done():
            campaign.cancel()
            await candidate.close()
            return
        if campaign.exception() is not None:  # not a win: never lead on a campaign that failed
            await candidate.close()
            raise RuntimeError(f"conductor {cfg.node.name}: the campaign through etcd failed") \
                from campaign.exception()
        log.warning("conductor %s leads", cfg.node.name)
    conductor = Conductor(cfg, name, expected_model(cfg), metrics)
    conductor.metrics.leader_changes.inc()
    await conductor.start()
    if health is not None:
        health.ready = True
    gc.freeze()  # the tokenizer and what transformers imported, as ``serve`` did for what came before
    lost = asyncio.create_task(candidate.lost.wait()) if candidate else None
    try:
        if frontend is not None:
            await frontend.start()
            http = asyncio.create_task(serve_http(cfg, frontend))
            await asyncio.wait({http, *([lost] if lost else [])}, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.wait({asyncio.create_task(stop.wait()), *([lost] if lost else [])},
                               return_when=asyncio.FIRST_COMPLETED)
    finally:
        await conductor.close()
        if health is not None:
            await health.close()
        if candidate is not None:
            await candidate.close()
    if lost is not None and lost.done():
        log.error("conductor %s stepped down (its etcd lease lapsed)", cfg.node.name)
        sys.exit(1)
