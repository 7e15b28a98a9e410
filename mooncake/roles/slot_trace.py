"""A decode's (or colocated instance's) spans of a traced request, written when it leaves the batch
from the times its ``Slot`` kept: ``<role>.request`` from the reservation to the end, with
``<role>.kv_landing`` (the reservation until all KV is in and the first token known: the KV
transfer, or a colocated instance's own prefill), ``<role>.decode_steps`` (one span for every
step it ran in, their count an attribute: never a span per token) and a ``preempted`` event when
it was given back. A request dropped before its first step gets the request span alone."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mooncake.kv.ingress import Slot
from mooncake.tracing import record_span

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


def trace_slot(tracer: "Tracer | None", role: str, slot: Slot, preempted: bool = False) -> None:
    """``slot``'s spans, the children of its request's trace (nothing if it has none)."""
    msg = slot.msg
    if tracer is None or not msg.trace or not slot.reserved_at:
        return
    now = time.monotonic()
    steps = max(0, slot.next_index - msg.num_generated - 1)
    root = record_span(tracer, f"{role}.request", slot.reserved_at, now, msg.trace, {
        "mooncake.request_id": msg.req_id, "mooncake.request_class": msg.sampling.request_class,
        "mooncake.prompt_tokens": len(msg.tokens), "mooncake.decode_steps": steps, "mooncake.preempted": preempted},
        events=[("preempted", now)] if preempted else None)
    if slot.started_at:
        record_span(tracer, f"{role}.kv_landing", slot.reserved_at, slot.started_at, root,
                    {"mooncake.blocks": len(slot.seq.block_table)})
        record_span(tracer, f"{role}.decode_steps", slot.started_at, now, root, {"mooncake.decode_steps": steps})
