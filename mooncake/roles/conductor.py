"""The conductor role's process: the Conductor, and (``[conductor] frontend``: by default, unless
under ``[coordination]``) a frontend in the same process serving the OpenAI API — the same code
as ``--role frontend``, talking to the conductor over its socket. Without it, the process
answers the health probes and ``/metrics`` on ``[node] health_port`` (if set).

Under ``[coordination]`` the conductor first campaigns through etcd and stands by until it
leads (its socket unbound meanwhile). A leader acts only while its lease is proven
(``election.py``): the moment it is not, the keepalive calls ``stop_acting`` — no message is
handled or sent after that — before etcd could expire the lease. If etcd then proves the same
lease again within ``[coordination] regain_s`` (etcd restarted, or out of reach for a moment: its
campaign key was never deleted, so nobody led meanwhile) it leads again, a new Conductor under the same term;
else it steps down: it drops what it held and exits non-zero (its supervisor starts it again, as a
candidate). The leader's term (``GET /cluster``'s ``leader_term``) is etcd's revision of its
campaign key; 0 without etcd (a single conductor, no election).
"""

from __future__ import annotations

import asyncio
import functools
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



def stop_acting(conductor: Conductor) -> None:
    """Act no more, from now on (the keepalive calls this in the step that finds the lease not
    proven, before any other task runs): the socket closes (nothing is handled after this; a send
    on a closed socket is dropped), and so do the clients its store orders go through (a
    ``close()`` follows, for the rest). A store order planned before (a task started but not yet
    run) may still go out."""
    if conductor.router is not None:
        conductor.router.close()
    conductor.replicator.close()


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
        log.warning("conductor %s leads (term %d)", cfg.node.name, candidate.term)
    expected = expected_model(cfg)
    stopped = asyncio.create_task(stop.wait())
    http: asyncio.Task | None = None
    metrics.leader_changes.inc()  # (not again when it leads again under the same term)
    try:
        while True:
            conductor = Conductor(cfg, name, expected, metrics)
            conductor.leader_term = candidate.term if candidate is not None else 0
            await conductor.start()  # (it does not yield: no message is handled before the next lines)
            if candidate is not None:
                candidate.on_lost = functools.partial(stop_acting, conductor)
                if candidate.lost.is_set():  # not proven since the win: not a message handled
                    stop_acting(conductor)
            if health is not None:
                health.ready = True
            gc.freeze()  # the tokenizer and what transformers imported, as ``serve`` did for what came before
            if frontend is not None and http is None:
                await frontend.start()
                http = asyncio.create_task(serve_http(cfg, frontend))
            lost = asyncio.create_task(candidate.lost.wait()) if candidate else None
            try:
                await asyncio.wait({http or stopped, *([lost] if lost else [])}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await conductor.close()
                if lost is not None:
                    lost.cancel()
            if lost is None or (http or stopped).done():
                return  # shut down
            candidate.on_lost = None
            if health is not None:
                health.ready = False
            log.error("conductor %s stopped acting: its etcd lease is not proven (waiting up to %.0fs for etcd "
                      "to prove it again)", cfg.node.name, cfg.coordination.regain_s)
            regained = asyncio.create_task(candidate.win(same_lease=True))
            await asyncio.wait({regained, http or stopped}, timeout=cfg.coordination.regain_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not regained.done() or regained.exception() is not None or not regained.result():
                regained.cancel()
                if (http or stopped).done():
                    return
                log.error("conductor %s stepped down (its etcd lease lapsed)", cfg.node.name)
                sys.exit(1)
            log.warning("conductor %s leads again (term %d)", cfg.node.name, candidate.term)
    finally:
        stopped.cancel()
        if health is not None:
            await health.close()
        if candidate is not None:
            await candidate.close()
