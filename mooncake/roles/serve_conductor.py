"""The conductor process: the Conductor plus its HTTP server (uvicorn)."""

from __future__ import annotations

import logging

import uvicorn

from mooncake.api.routes import build_app
from mooncake.config import Config
from mooncake.engine.loader import resolve_model_dir
from mooncake.roles.conductor import Conductor

log = logging.getLogger(__name__)


async def run_conductor(cfg: Config) -> None:
    from transformers import AutoTokenizer

    model_dir, name = resolve_model_dir(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conductor = Conductor(cfg, tokenizer, name)
    await conductor.start()
    c = cfg.conductor
    server = uvicorn.Server(uvicorn.Config(build_app(conductor), host=c.host, port=c.port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=5))
    log.info("conductor serving %s on http://%s:%d", name, c.host, c.port)
    try:
        await server.serve()
    finally:
        await conductor.close()
