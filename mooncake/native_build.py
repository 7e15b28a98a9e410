"""Building the project's own C code: compiled with the system C compiler into the user's
cache on first use (once per source and flags; processes that race write the same file, and
each lands whole), loaded through ctypes. Where it cannot be built or loaded (no compiler,
another OS) the caller gets None and keeps its pure-Python or torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mooncake" / "kernels"


def build(name: str, sources: list[Path], flags: list[str], directory: Path | None = None) -> Path | None:
    """The compiled shared library ``name`` (built now if missing), or None where it is not
    built and cannot be built here."""
    source = b"".join(p.read_bytes() for p in sources)
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = (directory or cache_dir()) / f"{name}-{key}.so"
    if target.is_file():  # built before (e.g. into a container image that has no compiler left)
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", tmp, *map(str, sources)], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: a process that races us loads a whole file
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        log.warning("%s not built (%s %s); using the fallback", name, e, err.decode(errors="replace")[-500:])
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return None
    return target


def load(name: str, sources: list[Path], flags: list[str], directory: Path | None = None) -> ctypes.CDLL | None:
    """``build`` and load it (Linux only), or None."""
    if not sys.platform.startswith("linux"):
        return None
    path = build(name, sources, flags, directory)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("%s not loaded (%s); using the fallback", name, e)
        return None
