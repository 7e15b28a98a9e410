"""Logging set-up of every role process: text lines, or one JSON object per line with
``MOONCAKE_LOG_FORMAT=json`` (inherited by the roles of ``mooncake serve``). Once a process
knows its role, every line names it and its instance (``role_tag``), so that the interleaved
output of a single-machine cluster says who wrote what."""

from __future__ import annotations

import json
import logging
import os
import time

_tag: dict[str, str] = {}


def role_tag(role: str, instance: str) -> str:
    """``prefill:node0-prefill``: how a role's lines name it (the supervisor looks for it)."""
    return f"{role}:{instance}"


class JSONFormatter(logging.Formatter):
    """``{"time", "level", "role"?, "instance"?, "logger", "message", "request_id"?, "exception"?}``."""

    def format(self, record: logging.LogRecord) -> str:
        from mooncake.api.request_id import current_request_id

        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + "Z",
               "level": record.levelname, **_tag, "logger": record.name, "message": record.getMessage()}
        rid = current_request_id.get()
        if rid:
            out["request_id"] = rid
        out.update(getattr(record, "fields", None) or {})  # a line's structured fields (the access log's timeline)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL [role:instance] logger: message``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(tag)s%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.tag = f"[{role_tag(_tag['role'], _tag['instance'])}] " if _tag else ""
        return super().format(record)


def log_format() -> str:
    fmt = os.environ.get("MOONCAKE_LOG_FORMAT", "text").lower()
    if fmt not in ("text", "json"):
        raise SystemExit(f"mooncake: MOONCAKE_LOG_FORMAT must be text or json, not {fmt!r}")
    return fmt


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if log_format() == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.captureWarnings(True)  # Python warnings become log lines, tagged like the rest


def tag_logs(role: str, instance: str, quiet_libraries: bool = True) -> None:
    """From now on every line names ``role`` and ``instance``; with ``quiet_libraries``, chatter
    that a user cannot act on (transformers' progress bars and advice) is kept to errors."""
    _tag.update(role=role, instance=instance)
    if not quiet_libraries:
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
