"""The one way tests and benchmarks start a whole cluster on this machine (``LocalCluster``),
with a config sized for a small shared machine."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mooncake.config import MOVED_FROM_CONDUCTOR, Config, MiB
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.ports import free_port

SHAPES: dict[str, dict[str, int]] = {"colocated": {"prefill": 0, "decode": 0, "colocated": 1},
                                     "pair": {"prefill": 1, "decode": 1}}
"""The shapes ``mooncake serve`` gives a user, as ``start_cluster`` counts: the colocated default (one
colocated instance) and the prefill/decode pair (``--disaggregated``). Test modules that start a
cluster to check a promise run it in each (``tests/test_shape_matrix.py`` holds them to it)."""


def serving_role(shape: str, half: str) -> str:
    """The role that runs ``half`` ("prefill" or "decode") of a request in ``shape``."""
    return "colocated" if SHAPES[shape].get("colocated") else half


def small_config(data_dir: Path, **conductor: object) -> Config:
    """A config sized for tests on a 2-core machine: small pools, one torch thread per role,
    float32 (outputs are compared with transformers token for token), every block written to the
    stores (``store_writes = "all"``: tests of the store find a prompt there after one request;
    the write admission's default is tested on its own), no queue bound (``max_queue_wait_s``:
    tests that burst expect every request served; the bound is tested on its own)."""
    cfg = Config()
    cfg.model.dtype = "float32"
    cfg.frontend.port = free_port()
    cfg.conductor.store_writes = "all"
    for k, v in conductor.items():  # the keys that moved out of [conductor] are taken here too
        setattr(getattr(cfg, MOVED_FROM_CONDUCTOR.get(k, "conductor")), k, v)
    cfg.engine.kv_cache_bytes = 160 * MiB
    cfg.engine.threads = 1
    cfg.engine.profile_at_start = False  # a few seconds per role; the admission tests turn it on
    cfg.admission.max_queue_wait_s = 0.0  # tests that burst expect every request served; tested on its own
    cfg.store.dram_bytes = 128 * MiB
    cfg.store.lmdb_bytes = 256 * MiB
    cfg.store.data_dir = str(data_dir)
    return cfg


def start_cluster(data_dir: Path | None = None, prefill: int = 1, decode: int = 1, store: int = 1,
                  cfg: Config | None = None, frontends: int = 1, colocated: int = 0, **conductor: object) -> LocalCluster:
    """A started dev cluster (the caller stops it): ``cfg``, or ``small_config(data_dir, **conductor)``;
    ``frontends`` > 1: frontend processes on consecutive ports (``cluster.urls``)."""
    if cfg is None:
        assert data_dir is not None
        cfg = small_config(data_dir, **conductor)
    if frontends > 1:
        cfg.frontend.port = free_port(consecutive=frontends)
    cluster = LocalCluster(cfg, prefill, decode, store, frontends=frontends, colocated=colocated)
    try:
        cluster.start(timeout_s=240)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextmanager
def running_cluster(*args: object, **kw: object) -> Iterator[LocalCluster]:
    """``start_cluster`` for a ``with`` block: the cluster is always stopped."""
    cluster = start_cluster(*args, **kw)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()
