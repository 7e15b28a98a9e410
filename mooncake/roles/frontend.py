"""The frontend role's process: a Frontend and its HTTP server (uvicorn). The conductor's
process runs the same pair unless ``[conductor] frontend = false`` (``roles/conductor.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal

import uvicorn

from mooncake.api.routes import build_app
from mooncake.config import Config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.frontend import Frontend
from mooncake.metrics import Metrics
from mooncake.security import check_network, role_endpoints

log = logging.getLogger(__name__)


def load_frontend(cfg: Config, metrics: Metrics | None = None, node_id: str = "") -> Frontend:
    """A frontend for the configured model (its tokenizer loaded); ``metrics``: the registry to count in."""
    from transformers import AutoTokenizer

    model_dir, name = resolve_model_dir(cfg.model)
    return Frontend(cfg, AutoTokenizer.from_pretrained(model_dir), name, metrics, node_id)


async def serve_http(cfg: Config, frontend: Frontend) -> None:
    """Serve the OpenAI API until SIGTERM/SIGINT: stop accepting, let in-flight responses finish
    (up to ``drain_timeout_s``), then close the frontend (what is left is dropped everywhere)."""
    f = cfg.frontend
    server = uvicorn.Server(uvicorn.Config(build_app(frontend), host=f.host, port=f.port, log_level="warning",
                                           lifespan="off",
                                           timeout_graceful_shutdown=int(cfg.liveness.drain_timeout_s)))
    # We own SIGTERM/SIGINT (uvicorn would re-raise them after shutting down): exit 0.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    log.info("frontend %s serving %s on http://%s:%d", frontend.node_id, frontend.model_name, f.host, f.port)
    try:
        await server.serve()
    finally:
        await frontend.close()


async def run_frontend(cfg: Config) -> None:
    check_network("frontend", role_endpoints(cfg, "frontend"), cfg.security.curve_keys_dir,
                  cfg.security.allow_insecure_network)
    frontend = load_frontend(cfg)
    await frontend.start()
    gc.freeze()  # the tokenizer and what transformers imported
    await serve_http(cfg, frontend)
