"""Store role: the tiered block store served over ZeroMQ, registered with the conductor.

Its node id is stable (``<node name>-store`` unless configured), because the
LMDB tier lives under it (and its P2P object records under ``data_dir/<node id>-p2p``,
see mooncake/p2p/service.py): a restarted store finds its blocks again and
re-announces them to the conductor's index, as it does whenever the conductor
asks it to register again. Its directory (``data_dir/<node id>``) is locked: a
second store with the same node id exits at start with a message that says so.

On SIGTERM (or SIGINT) the store stops serving, then moves its DRAM (and device)
blocks into LMDB for up to ``[liveness] drain_timeout_s``, so that a restart on
the same data dir hits; with ``[store] ssd_admission = "write_through"`` they are
mostly there already, and a crash loses at most the last write-through batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import zmq.asyncio

from mooncake import protocol as P
from mooncake.config import Config
from mooncake.roles.block_events import BlockEvents
from mooncake.roles.conductor_link import ConductorLink
from mooncake.roles.node_health import start_node_health
from mooncake.protocol.p2p import Forget
from mooncake.p2p.manifest import ObjectError
from mooncake.p2p.node_access import key_file, node_key, p2p_root, write_store_endpoint
from mooncake.p2p.service import P2PService
from mooncake.security import Curve, check_network, role_endpoints
from mooncake.sockets import DEFAULT_MAX_MSG_BYTES
from mooncake.tiers.dir_lock import DirLocked
from mooncake.tracing import role_tracer
from mooncake.tiers.server import StoreServer
from mooncake.tiers.tiered import TieredStore
from mooncake.tiers.write_budget import WriteBudget

log = logging.getLogger(__name__)
ANNOUNCE_CHUNK = 4096


async def run_store(cfg: Config) -> None:
    node_id = cfg.node.node_id or f"{cfg.node.name}-store"
    check_network("store", role_endpoints(cfg, "store"), cfg.security.curve_keys_dir,
                  cfg.security.allow_insecure_network)
    curve = Curve.from_dir(cfg.security.curve_keys_dir, "store")
    max_message_bytes = cfg.security.max_message_bytes or DEFAULT_MAX_MSG_BYTES
    loop = asyncio.get_running_loop()
    ctx = zmq.asyncio.Context()
    try:
        store = TieredStore.from_config(cfg.store, node_id, session_blocks_per_key=cfg.classes.session_blocks_per_key,
                                        session_share_per_key=cfg.classes.session_share_per_key)
    except DirLocked as e:
        raise SystemExit(f"mooncake store {node_id}: {e}") from None
    link: ConductorLink | None = None
    events = BlockEvents(node_id)  # reported to the conductor with the heartbeats, once registered

    def on_event(event: P.BlockEvent) -> None:  # called on the event loop
        events.add(event.kind, event.tier, event.hashes)

    port = cfg.node.store_port
    server = StoreServer(store, f"tcp://{cfg.node.host}:{port if port else '*'}", on_event=on_event,
                         node_id=node_id, curve=curve, max_message_bytes=max_message_bytes)
    budget = int(cfg.classes.store_write_share_per_key * store.placement.capacity_bytes)
    server.requests.budget = WriteBudget(budget)  # bytes one API key may write per minute
    server.requests.tracer = role_tracer(cfg.observability, "store")  # None: no tracing
    endpoint = await server.start()
    p2p_port = cfg.node.p2p_port
    root = p2p_root(cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
        key = node_key(cfg)
    except (OSError, ObjectError) as e:
        raise SystemExit(f"mooncake store {node_id}: P2P root or node key: {e}") from None
    private = [Path(cfg.store.data_dir).expanduser().resolve(), key_file(cfg)]  # never published
    try:
        p2p = P2PService(ctx, node_id, Path(cfg.store.data_dir).expanduser() / f"{node_id}-p2p",
                         f"tcp://{cfg.node.host}:{p2p_port or '*'}", cfg.conductor.endpoint, curve,
                         cfg.store.p2p_chunk_bytes, cfg.store.p2p_in_flight_per_peer, cfg.store.p2p_stall_timeout_s,
                         cfg.node.p2p_bulk_port, root=root, node_key=key, private=private)
    except OSError as e:  # the bulk port taken
        raise SystemExit(f"mooncake store {node_id}: {e.strerror or e}") from None
    write_store_endpoint(cfg, node_id, p2p.endpoint)  # the node's processes hand the key to this store only
    p2p.start()

    async def announce() -> None:
        by_tier: dict[str, list[bytes]] = {}
        for h, tier in server.stored_hashes():
            by_tier.setdefault(tier, []).append(bytes(h))
        for tier, hashes in by_tier.items():
            for i in range(0, len(hashes), ANNOUNCE_CHUNK):
                await link.send(P.BlockEvent(node_id, "stored", tier, hashes[i:i + ANNOUNCE_CHUNK]))
        log.info("store %s announced %d blocks", node_id, sum(map(len, by_tier.values())))
        await p2p.announce()

    def load() -> P.Load:
        snap = store.snapshot(top_n=0)
        return P.Load(tiers={t["name"]: P.TierLoad(t["used_bytes"], t["capacity_bytes"], t["blocks"], t["hits"],
                                                    t["evictions"], t["flex_blocks"], t["flex_evictions"],
                                                    t["session_blocks"])
                             for t in snap["tiers"]},
                      kv_rejected=server.rejections.snapshot(), kept_by_tenant=snap["kept_by_tenant"],
                      written_by_tenant=dict(server.requests.budget.written),
                      dropped_by_tenant=dict(server.requests.budget.dropped))

    reg = P.Register(role="store", node_id=node_id, endpoints={"store": endpoint, "p2p": p2p.endpoint},
                     info=P.NodeInfo(cfg.node.name, os.getpid(), instance=P.process_instance()))
    link = ConductorLink(ctx, cfg.conductor.endpoint, reg, load, on_registered=announce, curve=curve,
                         max_message_bytes=max_message_bytes, coordination=cfg.coordination,
                         fence=server.fence)  # one newest leadership term for the link and the store orders
    health = await start_node_health(cfg, "store", node_id)
    await link.connect(timeout_s=60)
    health.ready = True
    await announce()
    link.start_heartbeat(events)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    drain = asyncio.create_task(_drain(link, p2p))
    await stop.wait()
    try:  # plans stop naming this store now, not when it is found silent
        await asyncio.wait_for(link.send(P.Leave(node_id)), 1.0)
    except Exception as e:  # no conductor to tell: it finds the store gone
        log.warning("store %s could not tell the conductor it leaves: %s", node_id, e)
    drain.cancel()
    await p2p.close()
    await server.close()  # no new operations; those in flight have finished
    store.on_event = None
    t0 = time.monotonic()
    moved, left = await loop.run_in_executor(None, store.persist, t0 + cfg.liveness.drain_timeout_s)
    log.info("store %s persisted %d blocks to LMDB in %.2fs (%d left in memory)", node_id, moved,
             time.monotonic() - t0, left)
    link.close()
    store.close()  # LMDB synced and closed cleanly
    ctx.term()


async def _drain(link: ConductorLink, p2p: P2PService) -> None:
    """The conductor sends stores membership and P2P removals; keep the socket read."""
    while True:
        msg, _ = await link.recv()
        if isinstance(msg, Forget):
            p2p.forget(msg.name)
        else:
            log.warning("store ignores %s from the conductor", type(msg).__name__)
