"""The weights' fingerprint in a model's identity: sha256 over every byte of the weights.

KV block keys are chained from the model identity (``<name>@<fingerprint16>/<dtype>``),
and LMDB keys outlive processes, so the identity must change whenever any weight
changes: the digest covers ``config.json`` and every byte of every ``*.safetensors``
file (name, size, content). Hashing a model's weights takes a while (about a second per
GB), so the digest is computed once and cached in ``<cache_dir>/fingerprints/<key>``,
where the key hashes the model directory's path and each file's name, size, mtime,
ctime and inode: any rewrite of a file (even one that restores its mtime, which cannot
restore its ctime) computes the digest again. The cache file is written atomically, so
roles starting together may race for it harmlessly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
CHUNK = 8 << 20


def weight_files(model_dir: Path) -> list[Path]:
    return [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]


def cache_key(model_dir: Path) -> str:
    """What the cached digest is valid for: the directory and each file's identity and times."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in weight_files(model_dir):
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}".encode())
    return h.hexdigest()[:32]


def hash_weights(model_dir: Path) -> str:
    """sha256 over config.json and every safetensors file's name, size and every byte."""
    h = hashlib.sha256()
    for f in weight_files(model_dir):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(model_dir: str | Path, cache_dir: str | Path | None = None) -> str:
    """The hex digest of the model's weights (``hash_weights``), from the cache when it is valid.
    ``cache_dir`` None: no cache (hashed every time)."""
    model_dir = Path(model_dir)
    if cache_dir is None:
        return hash_weights(model_dir)
    entry = Path(os.path.expanduser(cache_dir)) / "fingerprints" / cache_key(model_dir)
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    digest = hash_weights(model_dir)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=entry.parent)
        with os.fdopen(fd, "w") as fh:
            fh.write(digest + "\n")
        os.replace(tmp, entry)
    except OSError as e:  # a read-only cache costs a re-hash next time, nothing else
        log.warning("cannot cache the weights fingerprint in %s: %s", entry.parent, e)
    log.info("weights of %s fingerprinted: %s", model_dir, digest[:16])
    return digest
