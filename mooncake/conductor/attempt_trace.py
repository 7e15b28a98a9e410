"""The conductor's spans of a traced attempt (``Submit.trace`` set): ``conductor.attempt`` from
the submit until its prefill is reported (or the attempt ends), with the prediction it was placed
on (TTFT, TBT, queue and reservation waits) and, once reported, the measured TTFT and the ratio;
under it ``conductor.admit_place``, the admission and placement with the candidates weighed.
Open spans are bounded (the oldest end first)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

from mooncake import protocol as P
from mooncake.tracing import record_span
from mooncake.tracing.context import context_of
from mooncake.tracing.spans import mono_ns

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

MAX_OPEN = 4096


class AttemptTraces:
    def __init__(self, tracer: "Tracer | None") -> None:
        self.tracer = tracer
        self.open: OrderedDict[str, "Span"] = OrderedDict()  # wire id -> its conductor.attempt span

    def wrap(self, on_submit: Callable[[Any, P.Submit], None], attempts: dict, cluster: Any) \
            -> Callable[[Any, P.Submit], None]:
        """``on_submit`` traced (itself when tracing is off): ``attempts`` the conductor's (wire id ->
        Attempt), ``cluster`` its nodes (the candidates weighed: the instances a prompt may go to)."""
        if self.tracer is None:
            return on_submit

        def traced(node: Any, msg: P.Submit) -> None:
            if not msg.trace or msg.wire_id in self.open:
                on_submit(node, msg)
                return
            t0 = time.monotonic()
            on_submit(node, msg)
            candidates = len(cluster.of_role("prefill")) + len(cluster.of_role("colocated"))
            self._placed(msg, attempts.get(msg.wire_id), t0, time.monotonic(), candidates)
        return traced

    def _placed(self, msg: P.Submit, a: Any, t0: float, t1: float, candidates: int) -> None:
        assert self.tracer is not None
        attrs: dict = {"mooncake.request_id": msg.wire_id, "mooncake.request_class": msg.sampling.request_class,
                       "mooncake.prompt_tokens": msg.n_tokens, "mooncake.candidates": candidates,
                       "mooncake.admitted": a is not None}
        if a is not None:
            plan = a.plan
            attrs.update({"mooncake.prefill": plan.prefill.node_id, "mooncake.decode": plan.decode.node_id,
                          "mooncake.predicted_ttft_s": plan.est_ttft_s, "mooncake.best_ttft_s": plan.best_ttft_s,
                          "mooncake.predicted_tbt_s": plan.est_tbt_s, "mooncake.predicted_queue_s": plan.queue_s,
                          "mooncake.predicted_reserve_wait_s": plan.reserve_wait_s,
                          "mooncake.reusable_blocks": plan.reusable_blocks, "mooncake.decode_batch": plan.decode_batch})
        root = self.tracer.start_span("conductor.attempt", context=context_of(msg.trace), attributes=attrs,
                                      start_time=mono_ns(t0))
        record_span(self.tracer, "conductor.admit_place", t0, t1, root, {"mooncake.admitted": a is not None})
        if a is None:
            root.end(end_time=mono_ns(t1))
            return
        self.open[msg.wire_id] = root
        while len(self.open) > MAX_OPEN:
            self.open.popitem(last=False)[1].end()

    def prefilled(self, wire_id: str, predicted_s: float, actual_s: float) -> None:
        """The attempt's prefill was reported ``actual_s`` after its placement."""
        s = self.open.pop(wire_id, None) if self.open else None
        if s is not None:
            s.set_attribute("mooncake.measured_ttft_s", actual_s)
            if predicted_s > 0:
                s.set_attribute("mooncake.ttft_prediction_ratio", actual_s / predicted_s)
            s.end()

    def ended(self, wire_id: str) -> None:
        s = self.open.pop(wire_id, None) if self.open else None
        if s is not None:
            s.end()
