"""What the prefill, decode and colocated roles share, held by each (composition, not a base
class): an engine on its own thread, the conductor link, the orders socket (where the frontends
drive their attempts: ``orders.py``), device-cache events, store clients (``kv.store_clients``),
failure reports and the role's main loop. The role itself is an ``EngineRole``: what it handles,
holds and reports."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from typing import Any, Callable, Protocol, TypeVar

import torch
import zmq
import zmq.asyncio

from mooncake import protocol as P
from mooncake.config import Config
from mooncake.engine import Engine, LoadedModel, Sequence, load_model
from mooncake.engine.errors import InvalidRequestError
from mooncake.engine.profile import one_profile_at_a_time, profile_engine
from mooncake.kv.integrity import Rejections
from mooncake.kv.store_clients import StoreClients
from mooncake.protocol.engine_profile import EngineProfile
from mooncake.roles.block_events import BlockEvents
from mooncake.roles.engine_thread import EngineThread
from mooncake.roles.conductor_link import ConductorLink
from mooncake.roles.node_health import start_node_health
from mooncake.roles.orders import Orders
from mooncake.roles.torch_threads import build_on_engine_thread
from mooncake.p2p.client import fetch_model
from mooncake.security import Curve, check_network, role_endpoints
from mooncake.tracing import role_tracer

log = logging.getLogger(__name__)
T = TypeVar("T")
# Fault injection for tests: the engine thread hangs forever after this many engine calls.
STALL_ENV = "MOONCAKE_FAULT_STALL_AFTER_CALLS"


def machine_id() -> str:
    """What the processes sharing this machine's cores have in common: the kernel's boot id
    (one per running kernel, so the same in every container and network namespace of a host),
    else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def node_id_for(cfg: Config, role: str) -> str:
    return cfg.node.node_id or f"{cfg.node.name}-{role}-{os.getpid()}"


class EngineRole(Protocol):
    """A role served by an ``EngineHost``: prefill, decode or colocated."""

    async def handle(self, msg: P.Msg, tensors: list[torch.Tensor]) -> None:
        """An order from a frontend, or a message from the conductor."""

    def held_requests(self) -> list[str]:
        """Wire ids of every request this role holds: queued, reserved or running."""

    def busy(self) -> bool:
        """Whether the role holds requests (drained on shutdown; a stall is judged on it)."""

    def load(self) -> P.Load:
        """The heartbeat's report (``EngineHost.load`` and the role's own figures)."""

    async def close(self) -> None:
        """The role's own sockets, then its host's (``EngineHost.close``)."""


class EngineHost:
    """One role's engine and links. Engine calls go through ``run_engine``: one thread owns the
    engine (the most urgent call first), the event loop never computes."""

    def __init__(self, cfg: Config, role: str) -> None:
        self.cfg = cfg
        self.role = role
        self.step_tokens = 0  # a colocated instance's fixed tokens per step (0: from its target)
        self.step_target_ms = 0.0  # a colocated instance's step time target while interactive work decodes
        self.node_id = node_id_for(cfg, self.role)
        check_network(self.role, role_endpoints(cfg, self.role), cfg.security.curve_keys_dir,
                      cfg.security.allow_insecure_network)
        self.curve = Curve.from_dir(cfg.security.curve_keys_dir, self.role)
        fetch_model(cfg, self.role)  # [model] p2p_name: a missing model directory comes from peers first
        self.pool = EngineThread(f"{self.role}-engine")
        (self.loaded, self.engine, self.profile), self.threads = build_on_engine_thread(
            self.pool, cfg.engine.threads, self._build_engine)
        self.facts = P.ModelFacts(self.engine.model_id, self.engine.block_tokens, self.engine.max_model_len,
                                  self.engine.vocab_size, tuple(self.engine.block_shape),
                                  int(self.engine.model.embed.shape[1]))
        self.ctx = zmq.asyncio.Context()
        # A frame is at most one KV block (plus headers): a peer sending more is disconnected.
        self.max_message_bytes = cfg.security.max_message_bytes or max(16 << 20, 4 * self.engine.block_bytes)
        self.rejections = Rejections()  # KV refused (forged or corrupt), by reason
        self.stores = StoreClients(self.curve, self.max_message_bytes, self.rejections, cfg.security,
                                   self.engine.model_id, self.node_id, self._export_blocks)
        self.block_events = BlockEvents(self.node_id)
        self.tasks: list[asyncio.Task] = []  # the role's background tasks (cancelled on close)
        self.link: ConductorLink | None = None
        self.served: EngineRole | None = None  # the role, once serving
        self.orders: Orders | None = None
        self.progress = 0  # engine steps completed (heartbeats carry it: a stuck engine shows)
        self.tracer = role_tracer(cfg.observability, self.role)  # None: no tracing (``mooncake/tracing``)
        stall = os.environ.get(STALL_ENV, "")
        self._stall_after = int(stall) if stall.isdigit() else -1

    async def run_engine(self, fn: Callable[..., T], *args: Any, urgency: int | None = None) -> T:
        """``fn(*args)`` on the engine thread, after the more urgent calls (``engine_thread.py``;
        ``urgency``: a request class's rank, default the caller's context's)."""
        if self._stall_after == 0:
            self.pool.submit(threading.Event().wait, urgency=-1)  # the engine thread never returns
            log.error("fault injection: engine thread stalled")
        self._stall_after -= 1
        return await asyncio.wrap_future(self.pool.submit(fn, *args, urgency=urgency))

    def _build_engine(self) -> tuple[LoadedModel, Engine, EngineProfile | None]:
        """The model, its engine and its start-up profile (on the engine thread: ``torch_threads.py``)."""
        loaded = load_model(self.cfg.model)
        classes = self.cfg.classes
        engine = Engine(loaded, self.cfg.engine, classes.session_blocks_per_key, classes.session_share_per_key)
        return loaded, engine, self._profile_engine(engine)

    def _profile_engine(self, engine: Engine) -> EngineProfile | None:
        """Time ``engine`` before serving (prefill sizes or decode batches, by role)."""
        if not self.cfg.engine.profile_at_start:
            return None
        sizes = {"decode_batches": ()} if self.role == "prefill" else {"prefill_sizes": ()} if self.role == "decode" else {}
        with one_profile_at_a_time():
            p = profile_engine(engine, **sizes)
        log.info("%s profiled in %.1fs: %s", self.node_id, p.seconds, describe_profile(p))
        return p

    def register_msg(self, endpoints: dict[str, str]) -> P.Register:
        info = P.NodeInfo(self.cfg.node.name, os.getpid(), self.facts, self.engine.num_blocks,
                          self.engine.block_bytes, self.profile, cpus=len(os.sched_getaffinity(0)),
                          threads=self.threads, machine=machine_id(), instance=P.process_instance(),
                          kv_block_bytes=self.engine.kv_block_bytes, step_tokens=self.step_tokens,
                          step_target_ms=self.step_target_ms)
        return P.Register(role=self.role, node_id=self.node_id, info=info, endpoints=endpoints)

    async def _export_blocks(self, seq: Sequence, first: int, end: int) -> torch.Tensor | None:
        """A copy of ``seq``'s blocks ``[first, end)`` (for a store), read on the engine thread; None
        if the sequence was freed meanwhile (its blocks may hold another's KV by now)."""
        return await self.run_engine(lambda: None if seq.freed else self.engine.kv.export_sequence(seq, first, end))

    # ---- reports

    def load(self, pending: bool) -> P.Load:
        """What every role reports (``pending``: whether its engine has work)."""
        st = self.engine.stats()
        return P.Load(free_blocks=st["free_blocks"] + st["cached_blocks"], used_blocks=st["used_blocks"],
                      sequences=st["sequences"], progress=self.progress, pending=pending,
                      kv_rejected=self.rejections.snapshot(), writes_dropped=self.stores.writes_dropped,
                      evicted=st["evicted_blocks"], kept_blocks=st["session_cached_blocks"],
                      kept_by_tenant=st["kept_by_tenant"], speculative=st["speculative"])

    async def send(self, msg: P.Msg) -> None:
        """An attempt's report to the frontend that ordered it; anything else to the conductor."""
        if self.orders is not None and await self.orders.reply(msg):
            return
        assert self.link is not None
        await self.link.send(msg)

    async def fail(self, req_id: str, error: BaseException | str, kind: P.FailureKind | None = None) -> None:
        """Report a request this worker cannot serve, once. An invalid request is FATAL (it would
        fail anywhere); anything else may succeed elsewhere."""
        param = ""
        if kind is None:
            kind = P.FailureKind.FATAL if isinstance(error, InvalidRequestError) else P.FailureKind.RETRY
            param = getattr(error, "param", None) or ""
        message = error if isinstance(error, str) else (
            str(error) if isinstance(error, InvalidRequestError) else f"{type(error).__name__}: {error}")
        await self.send(P.Failed(req_id, self.node_id, message, kind, param))

    # ---- device prefix cache events -> conductor (with the heartbeats)

    def publish_device_cache(self) -> None:
        loop = asyncio.get_running_loop()

        def on_event(kind: str, hashes: list) -> None:  # engine thread
            loop.call_soon_threadsafe(self.block_events.add, kind, "device", [bytes(h) for h in hashes])

        self.engine.on_block_event = on_event

    async def _announce_device_cache(self) -> None:
        """After a re-registration (a new conductor, or back from being declared dead): every block
        the device cache holds, so that routing by prefix is not blind to it."""
        if self.engine.on_block_event is None:
            return
        hashes = await self.run_engine(lambda: [bytes(h) for h in self.engine.blocks.cached])
        self.block_events.add("stored", "device", hashes)

    # ---- main loop

    async def serve(self, role: EngineRole, endpoints: dict[str, str]) -> None:
        """Register with the conductor, then hand ``role`` its messages (and frontends' orders) until stopped."""
        self.served = role
        orders = self.orders = Orders(self.ctx, self.cfg.node.host, self.curve, self.max_message_bytes, self.node_id,
                                      role.handle)
        self.tasks.append(asyncio.create_task(orders.serve(role.held_requests)))
        self.link = ConductorLink(self.ctx, self.cfg.conductor.endpoint,
                                  self.register_msg({**endpoints, "orders": orders.endpoint}), role.load,
                                  curve=self.curve, max_message_bytes=self.max_message_bytes,
                                  holding=role.held_requests, fallback=orders.placed_alone,
                                  on_orphans=self._drop_orphans,
                                  on_registered=self._announce_device_cache, coordination=self.cfg.coordination)
        health = await start_node_health(self.cfg, self.role, self.node_id)
        await self.link.connect(timeout_s=60)
        health.ready = True
        self.link.start_heartbeat(self.block_events)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        receiver = asyncio.create_task(self._receive())
        await stop.wait()
        await self.drain(role)
        receiver.cancel()
        await role.close()

    async def _drop_orphans(self, wire_ids: list[str]) -> None:
        """Reconciliation: what the conductor no longer knows here is dropped as if aborted."""
        for wire_id in wire_ids:
            await self.served.handle(P.Abort(wire_id), [])

    async def drain(self, role: EngineRole) -> None:
        """Tell the conductor we are leaving, then let ``role``'s in-flight work finish (bounded)."""
        await self.send(P.Leave(self.node_id))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.liveness.drain_timeout_s
        while role.busy() and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if role.busy():
            log.warning("%s: drain timed out, dropping what is left: %s", self.node_id, role.load())
        if self.stores.writes:  # blocks on their way to a store
            await asyncio.wait(set(self.stores.writes), timeout=max(0.1, deadline - loop.time()))

    async def _receive(self) -> None:
        assert self.link is not None
        while True:
            msg, tensors = await self.link.recv()
            try:
                if isinstance(msg, P.FrontendGone):
                    await self._drop_orphans(self.orders.ordered_by_frontend(msg, self.served.held_requests()))
                    continue
                await self.served.handle(msg, tensors)
            except Exception as e:  # a bad message never kills the role; its request is reported
                req_id = getattr(msg, "req_id", "")
                log.exception("error handling %s %s", type(msg).__name__, req_id)
                if req_id and not isinstance(msg, P.Abort):
                    await self.fail(req_id, e)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.stores.close()
        if self.link is not None:
            self.link.close()
        if self.orders is not None:
            self.orders.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.curve is not None:
            self.curve.stop()
        self.ctx.term()


def describe_profile(p: EngineProfile) -> str:
    """``prefill 128 tokens 509 ms, 128 tokens after 1024 cached 3205 ms; decode batch 8 holding
    1024 tokens 285 ms/step``."""
    parts = []
    if p.prefill:
        parts.append("prefill " + ", ".join(f"{new} tokens{f' after {old} cached' if old else ''} {s * 1e3:.0f} ms"
                                            for new, old, s in p.prefill))
    if p.decode:
        parts.append("decode " + ", ".join(f"batch {b} holding {kv} tokens {s * 1e3:.0f} ms/step"
                                           for b, kv, s in p.decode))
    return "; ".join(parts) or "nothing measured"
