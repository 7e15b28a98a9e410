"""One store per directory: an exclusive ``fcntl.flock`` on ``DIR/LOCK`` for the life of the process.

Several stores share one ``data_dir``, each in its own sub-directory
(``data_dir/<node id>``); a second store with the same node id fails at start
with ``DirLocked``, which names the directory and the holder's pid. The kernel
drops the lock when the holder exits, however it exits (SIGKILL included), so a
stale LOCK file never blocks a restart.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DirLocked(RuntimeError):
    """Another process (or another store in this one) already uses the directory."""


class DirLock:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "LOCK"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirLocked(f"store directory {self.directory} is locked by another store (pid {holder}): "
                            "two stores cannot share a node id; give each its own [node] node_id "
                            "(or [node] name) under the shared data_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
