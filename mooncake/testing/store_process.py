"""A standalone store server (``python -m mooncake.tiers.server``) in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout: the child imports this copy of mooncake


def start_store_process(data_dir: Path | str, *args: str, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """A standalone store server on a free port: (process, endpoint). The caller stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.tiers.server", "--endpoint", "tcp://127.0.0.1:0",
                             "--data-dir", str(data_dir), *args], cwd=SOURCE_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(SOURCE_ROOT)})
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line or not line[0].startswith("READY "):
        proc.kill()
        raise RuntimeError(f"store did not start: {line} {proc.communicate()[1][-2000:]}")
    return proc, line[0].split()[1]


@contextmanager
def store_process(data_dir: Path | str, *args: str, timeout: float = 60.0) -> Iterator[str]:
    """A standalone store server on a free port; yields its endpoint; always torn down."""
    proc, endpoint = start_store_process(data_dir, *args, timeout=timeout)
    try:
        yield endpoint
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
