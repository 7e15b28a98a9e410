"""The CURVE keys of a Kubernetes deployment, for its key Secret.

Every pod talks to the others at its pod IP, off loopback, where a role without keys refuses
to start (``mooncake.security.check_network``). So the pods get keys: those of ``[security]
curve_keys_dir`` when set, else new ones generated as ``mooncake keys`` generates them; none
only where the config says ``allow_insecure_network = true``. Each pod mounts the public keys
and the secret key of its own role's kind (``deploy/pods.py``); each frontend has a key of its
own (``frontend-NAME``, or the one ``frontend`` pair for one frontend), in a Secret of its own.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import zmq

from mooncake.config import Config
from mooncake.security import KINDS, generate_keys

KEY_FILES = tuple(f"{kind}.{ext}" for kind in KINDS if kind != "frontend" for ext in ("key", "key_secret"))
_REMEDY = ("create keys with `mooncake keys DIR` and set [security] curve_keys_dir = DIR, or, on a network "
           "you trust, set [security] allow_insecure_network = true")


class KeysError(ValueError):
    """No keys for the pods, and none can be generated; the message says what to do."""


def frontend_stems(files: dict[str, str]) -> list[str]:
    """The frontend keypairs among the key files (``frontend``, ``frontend-NAME``), sorted."""
    return sorted(stem for name in files if (stem := name.removesuffix(".key_secret")) != name
                  and (stem == "frontend" or stem.startswith("frontend-")) and f"{stem}.key" in files)


def _read_keys(directory: Path, frontends: int = 1) -> dict[str, str]:
    files = {p.name: p.read_text() for p in sorted(directory.glob("*")) if p.is_file()} if directory.is_dir() else {}
    missing = [name for name in KEY_FILES if name not in files]
    have = frontend_stems(files)
    if not missing and len(have) < frontends:
        names = " ".join(f"--frontend {i}" for i in range(frontends))
        raise KeysError(f"[security] curve_keys_dir {directory} holds {len(have)} frontend key(s) "
                        f"({', '.join(have) or 'none'}) for {frontends} frontends, each of which needs its own: "
                        f"add them with: mooncake keys {directory} --frontends-only {names}")
    if missing:
        raise KeysError(f"[security] curve_keys_dir {directory} lacks {', '.join(missing)} "
                        f"(create them with: mooncake keys {directory})")
    bad = [n for n in files if not re.match(r"^[-._a-zA-Z0-9]+$", n)]
    if bad:
        raise KeysError(f"curve key file names not usable as Secret keys: {bad}")
    return files


def _new_keys(frontends: int) -> dict[str, str]:
    if not zmq.has("curve"):
        raise KeysError(f"the pods need CURVE keys, but this libzmq cannot generate them (built without CURVE): "
                        f"{_REMEDY}")
    with tempfile.TemporaryDirectory(prefix="mooncake-keys-") as d:
        try:
            generate_keys(d, [str(i) for i in range(frontends)])
        except (OSError, zmq.ZMQError) as e:
            raise KeysError(f"the pods need CURVE keys, but generating them failed ({e}): {_REMEDY}") from None
        return _read_keys(Path(d), frontends)


def pod_key_files(cfg: Config, frontends: int = 1) -> dict[str, str]:
    """File name -> contents of the key files the pods mount (with a keypair for each of
    ``frontends``); {} where the config allows running without keys (``allow_insecure_network``
    and no ``curve_keys_dir``)."""
    if cfg.security.curve_keys_dir:
        return _read_keys(Path(cfg.security.curve_keys_dir).expanduser(), frontends)
    if cfg.security.allow_insecure_network:
        return {}
    return _new_keys(frontends)
