"""The conductor role's process: the Conductor plus its HTTP server (uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal

import uvicorn

from mooncake.api.routes import build_app
from mooncake.conductor import Conductor
from mooncake.conductor.expected_model import expected_model
from mooncake.config import Config
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.security import check_network, role_endpoints

log = logging.getLogger(__name__)


async def run_conductor(cfg: Config) -> None:
    from transformers import AutoTokenizer

    check_network("conductor", role_endpoints(cfg, "conductor"), cfg.security.curve_keys_dir,
                  cfg.security.allow_insecure_network)
    model_dir, name = resolve_model_dir(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conductor = Conductor(cfg, tokenizer, name, expected_model(cfg))
    await conductor.start()
    gc.freeze()  # the tokenizer and what transformers imported, as ``serve`` did for what came before
    c = cfg.conductor
    server = uvicorn.Server(uvicorn.Config(build_app(conductor), host=c.host, port=c.port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=int(c.drain_timeout_s)))
    # We own SIGTERM/SIGINT (uvicorn would re-raise them after shutting down): stop accepting,
    # let in-flight responses finish (up to timeout_graceful_shutdown), exit 0.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    log.info("conductor serving %s on http://%s:%d", name, c.host, c.port)
    try:
        await server.serve()
    finally:
        await conductor.close()
