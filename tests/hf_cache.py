"""A local Hugging Face cache laid out as the hub client writes it (tests; no network)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache_with(model_dir: Path, cache: Path, repo_id: str, commit: str = COMMIT, ref: bool = True) -> Path:
    """Lay ``model_dir`` out as the Hugging Face cache does: blobs, and a snapshot of symlinks."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for i, f in enumerate(sorted(model_dir.iterdir())):
        blob = repo / "blobs" / f"{commit[:8]}{i:04d}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(blob)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snap
