"""Models named the way users name them: a Hugging Face repo id (``org/name``) resolved
from the local Hugging Face cache, without network access.

The cache is ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``), else
``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``);
a repo lives in ``models--org--name/snapshots/<commit>``, with ``refs/main`` naming the
commit of the main branch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mooncake.engine.errors import ModelLoadError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def hub_cache_dir() -> Path:
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expanduser(explicit))
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def is_repo_id(name: str) -> bool:
    """``org/name`` (one slash, no path syntax)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name


def snapshot_dir(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id``'s main branch; ModelLoadError naming the cache if absent."""
    cache = hub_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    hint = (f"download it first (hf download {repo_id}), point HF_HUB_CACHE/HF_HOME at the cache "
            f"that has it, or give a local directory or GGUF file")
    if not repo.is_dir():
        raise ModelLoadError(f"model {repo_id!r} is not in the local Hugging Face cache {cache} "
                             f"(no {repo.name}); {hint}")
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if snap.is_dir():
            return snap
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise ModelLoadError(f"model {repo_id!r} in the local Hugging Face cache {cache} has "
                         f"{'no usable snapshot' if not found else f'{len(found)} snapshots and no refs/main'}; {hint}")


def repo_id_of(path: Path) -> str | None:
    """``org/name`` if ``path`` is a snapshot directory of the Hugging Face cache, else None."""
    parent = path.resolve().parent if path.exists() else path.parent
    if parent.name != "snapshots" or not parent.parent.name.startswith("models--"):
        return None
    return parent.parent.name.removeprefix("models--").replace("--", "/", 1)
