"""Who may make a store publish or fetch, and where: the node's own processes, inside ``p2p_root``.

A store's P2P port is reachable by every peer (chunks travel between stores), so its object
requests (``PutObject``, ``GetObject``, ``Progress``) carry the node key: random bytes the store
writes at start-up into its data directory, readable only by its user. The node's CLI and its
workers (run with the node's configuration, so with the same ``[store] data_dir``) read it; a peer
elsewhere, CURVE key or not, has no way to. Paths are confined to ``[node] p2p_root``: a store
publishes only files under it and writes fetched objects only there, whatever the asker names.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from urllib.parse import quote

from mooncake.config import Config
from mooncake.p2p.manifest import ObjectError

KEY_BYTES = 32


def p2p_root(cfg: Config) -> Path:
    """``[node] p2p_root``, else ``<[store] data_dir>/p2p-objects``; absolute, links resolved."""
    root = cfg.node.p2p_root or str(Path(cfg.store.data_dir) / "p2p-objects")
    return Path(root).expanduser().resolve()


def confined(root: Path, path: str | Path) -> Path:
    """``path`` (absolute, links resolved) if it lies under ``root``; else ObjectError naming p2p_root."""
    if not os.path.isabs(path):
        raise ObjectError(f"{path}: give an absolute path (the store resolves it on its machine)")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        raise ObjectError(f"{path} is outside this store's p2p_root ({root}): a store publishes and fetches "
                          f"only there ([node] p2p_root, MOONCAKE_NODE_P2P_ROOT)")
    return resolved


def _key_path(cfg: Config) -> Path:
    if cfg.node.p2p_key_file:
        return Path(cfg.node.p2p_key_file).expanduser()
    return Path(cfg.store.data_dir).expanduser() / f"p2p-{quote(cfg.node.name, safe='')}.key"


def node_key(cfg: Config) -> str:
    """The node key, created (mode 0600) if this node has none yet: the store calls this at start."""
    path = _key_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".key.{os.getpid()}")  # written whole, then linked: never an empty key file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(KEY_BYTES))
    try:
        os.link(tmp, path)  # fails if the node has a key already: that one stays
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return read_node_key(cfg)


def read_node_key(cfg: Config) -> str:
    """The node key its store wrote; ObjectError if there is none (not this node, or another data_dir)."""
    path = _key_path(cfg)
    try:
        key = path.read_text().strip()
    except OSError as e:
        raise ObjectError(f"cannot read this node's P2P key {path} ({e.strerror}): run on the store's node, "
                          f"with its configuration ([store] data_dir, [node] p2p_key_file), as its user") from None
    if len(key) != 2 * KEY_BYTES:
        raise ObjectError(f"{path} is not a P2P node key")
    return key


def key_file(cfg: Config) -> Path:
    """Where the node key lies (never to be published: ``P2PService`` refuses a tree holding it)."""
    return _key_path(cfg).resolve()


def _endpoint_path(cfg: Config, store_id: str) -> Path:
    return _key_path(cfg).with_suffix(".stores") / quote(store_id, safe="")


def write_store_endpoint(cfg: Config, store_id: str, endpoint: str) -> None:
    """Beside the key, the P2P endpoint a store of this node serves on (rewritten at each start): the
    node's processes hand the key only to such a store, not to whatever registers under the node's
    name with the conductor."""
    path = _endpoint_path(cfg, store_id)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(endpoint)
    os.replace(tmp, path)


def read_store_endpoint(cfg: Config, store_id: str) -> str:
    """The endpoint the store ``store_id`` of this node wrote ("" if it wrote none)."""
    try:
        return _endpoint_path(cfg, store_id).read_text().strip()
    except OSError:
        return ""


def same_key(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
