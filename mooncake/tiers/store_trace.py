"""The store's span of a traced request (one that carries a ``trace``): ``store.get`` / ``store.put``
(and their shared-memory forms), with the blocks asked, found or stored, their bytes and the tiers
they were read from or written to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch

from ..protocol import Get, Msg, Put, ShmGet, ShmPut
from ..tracing import span
from .tiered import TieredStore

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


async def traced_request(tracer: "Tracer", store: TieredStore, msg: Msg, tensors: list[torch.Tensor], trace: str,
                         handle: Callable[[Msg, list[torch.Tensor]], Awaitable[list]]) -> list:
    """``handle(msg, tensors)`` in a span, the child of ``trace``."""
    op = {Get: "get", ShmGet: "get", Put: "put", ShmPut: "put"}.get(type(msg), type(msg).__name__.lower())
    hashes = getattr(msg, "hashes", [])
    attrs: dict[str, Any] = {"mooncake.store.op": op, "mooncake.store.blocks": len(hashes),
                             "mooncake.store.shm": isinstance(msg, (ShmGet, ShmPut))}
    tiers = [t.name for t in store.tiers]
    if op == "get":
        where = [store.placement.where.get(bytes(h)) for h in hashes]  # before the read promotes them
        found = [tiers[i] for i in where if i is not None and i < len(tiers)]
        attrs["mooncake.store.tiers"] = ",".join(sorted(set(found))) or "none"
        attrs["mooncake.store.found_blocks"] = len(found)
    else:
        attrs["mooncake.store.tiers"] = tiers[0] if tiers else ""
        attrs["mooncake.store.bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    with span(tracer, f"store.{op}", trace, attrs) as s:
        reply = await handle(msg, tensors)
        if op == "get":
            s.set_attribute("mooncake.store.bytes", sum(int(getattr(f, "nbytes", 0)) for f in reply[1:]))
        return reply
