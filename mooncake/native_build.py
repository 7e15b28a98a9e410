"""The project's own C libraries (``LIBRARIES``): compiled at install time, loaded through ctypes.

``pip install`` (also ``pip install -e``) compiles each one into the package's ``_native/``
directory (``setup.py``'s ``build_native`` step, which calls ``build_all``) as
``<name>-<key>.so``, the key hashing its sources and flags: a library built from sources that
have changed since (an editable install) is never loaded. The loader looks there first; where
that file is missing (no compiler at install time, edited sources) it compiles the library
into the user's cache on first use (once per key; processes that race write the same file, and
each lands whole) and finds it there again, also where no compiler is left (a container image).
Where none of that works (no compiler, a build error, a CPU without the instructions the code
is compiled for, another OS) the caller gets None and keeps its pure-Python or torch path, and
one warning line says why.

The flags name instruction sets (``-mavx512f``, ...) rather than ``-march=native``: a library
built at install time runs on any CPU that has them (checked in ``/proc/cpuinfo`` before
loading), also where the package was built on another machine.
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
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).parent
INSTALLED_DIR = PACKAGE_DIR / "_native"  # where ``pip install`` puts the libraries


class Unavailable(Exception):
    """A library cannot be had here; the message says why (it is shown to the user)."""


@dataclass(frozen=True)
class Library:
    name: str
    sources: tuple[Path, ...]
    flags: tuple[str, ...]
    fallback: str  # what runs instead, said in the warning where the library is off
    cpu_flags: tuple[str, ...] = ()  # /proc/cpuinfo flags the compiled code needs

    def file_name(self) -> str:
        """``<name>-<key>.so``, the key a hash of the sources and flags."""
        source = b"".join(p.read_bytes() for p in self.sources)
        key = hashlib.sha256(source + " ".join(self.flags).encode()).hexdigest()[:16]
        return f"{self.name}-{key}.so"


KERNELS = Library(  # the decode engine's kernels (engine/kernels/native.py, native_decode.py)
    "mooncake-kernels", (PACKAGE_DIR / "engine" / "kernels" / "quant_gemv.c", PACKAGE_DIR / "engine" / "kernels" / "decode_kernels.c",
                         PACKAGE_DIR / "engine" / "kernels" / "int4_vnni.c"),
    ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mavx512vnni", "-fopenmp"),
    "decode runs torch's ops instead, several times slower per layer",
    ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"))
FINGERPRINT_TABLE = Library(  # the KV index's block table (sched/fingerprint_table.py)
    "mooncake-fingerprint-table", (PACKAGE_DIR / "sched" / "fingerprint_table.c",), ("-O2",),
    "the KV index walks Python sets instead (slower per scheduling decision)")
LIBRARIES = (KERNELS, FINGERPRINT_TABLE)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mooncake" / "kernels"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def check_runs_here(library: Library) -> None:
    """Raises Unavailable where this machine cannot run ``library`` (not Linux, CPU features missing)."""
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"not Linux ({sys.platform})")
    have = _cpu_flags()
    missing = [flag for flag in library.cpu_flags if flag not in have]
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")


def _first_error(stderr: bytes) -> str:
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or ["no message"])[0][-300:]


def compile_to(library: Library, target: Path) -> None:
    """Compiles ``library`` into ``target`` (written whole or not at all); raises Unavailable naming why not."""
    requested = os.environ.get("CC", "cc")
    compiler = shutil.which(requested) or shutil.which("gcc")
    if compiler is None:
        raise Unavailable(f"no C compiler (neither CC={requested} nor gcc is on PATH)")
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        subprocess.run([compiler, *library.flags, "-shared", "-fPIC", "-o", tmp, *map(str, library.sources)],
                       check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide an installed library from other users
        os.replace(tmp, target)  # atomic: a process that races us loads a whole file
        tmp = None
    except subprocess.CalledProcessError as e:
        raise Unavailable(f"the build failed ({compiler}: {_first_error(e.stderr)})") from e
    except (OSError, subprocess.SubprocessError) as e:
        raise Unavailable(f"the build failed ({e})") from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def build(library: Library, directory: Path | None = None) -> Path:
    """The library's file: the one installed with the package, else the one built before into
    ``directory`` (the user's cache by default), else built there now; raises Unavailable."""
    name = library.file_name()
    cached = (directory or cache_dir()) / name
    for path in (INSTALLED_DIR / name, cached):
        if path.is_file():
            return path
    compile_to(library, cached)
    return cached


def build_all(directory: Path, libraries: tuple[Library, ...] = LIBRARIES) -> list[Path]:
    """The install-time step: compiles each library into ``directory``, replacing its older builds
    there; one that cannot be built is left to the first use (a warning says why). The files built."""
    built = []
    for library in libraries:
        target = directory / library.file_name()
        try:
            compile_to(library, target)
        except Unavailable as e:
            log.warning("%s not built at install time: %s; it is built on first use where it can be", library.name, e)
            continue
        for old in directory.glob(f"{library.name}-*.so"):
            if old != target:
                old.unlink()
        built.append(target)
    return built


def load(library: Library, directory: Path | None = None) -> ctypes.CDLL | None:
    """The loaded library (``build`` where needed), or None where it cannot run here; then one
    warning says why (callers load once per process)."""
    try:
        check_runs_here(library)
        path = build(library, directory)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise Unavailable(f"{path} does not load ({e})") from e
    except Unavailable as e:
        log.warning("native library %s off: %s; %s", library.name, e, library.fallback)
        return None
    log.info("native library %s on (%s)", library.name, path)
    return lib
