"""Logging set-up of every role process: text lines, or one JSON object per line with
``MOONCAKE_LOG_FORMAT=json`` (inherited by the roles of ``mooncake serve --dev``)."""

from __future__ import annotations

import json
import logging
import os
import time


class JSONFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", "request_id"?, "exception"?}``."""

    def format(self, record: logging.LogRecord) -> str:
        from mooncake.api.request_id import current_request_id

        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        rid = current_request_id.get()
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str) -> None:
    fmt = os.environ.get("MOONCAKE_LOG_FORMAT", "text").lower()
    if fmt not in ("text", "json"):
        raise SystemExit(f"mooncake: MOONCAKE_LOG_FORMAT must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
