"""Opt-in instrumentation for benchmark runs: what the conductor predicted for each request at
admission, and what happened. Not part of the server; loaded only when this directory is on
PYTHONPATH and ``ADMISSION_TRACE_FILE`` names a JSONL file (the same hook works on any
checkout of the code, so before/after comparisons use one instrument):

    ADMISSION_TRACE_FILE=/tmp/trace.jsonl PYTHONPATH=benchmarks/admission_trace:. \\
        python benchmarks/bench_e2e.py --systems cache_aware_slo ...

In the conductor process it wraps ``Conductor._dispatch`` / ``Admission.check_plan`` (one
``plan`` record per admission decision: the predictions, the verdict, which check refused, the
chosen prefill instance's queue) and ``_on_prefill_done`` (one ``prefilled`` record: predicted vs
realized); in the benchmark's client it sends ``X-Request-Id: b<record id>`` with every request,
so the conductor's ids lead with the client's record id. ``benchmarks/admission_trace/analyze.py``
joins the records with the client's TTFTs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import math
import os
import sys
import time

PATH = os.environ.get("ADMISSION_TRACE_FILE", "")


def _f(x: float) -> float | None:
    return round(x, 4) if isinstance(x, (int, float)) and math.isfinite(x) else None


class _Out:
    fh = None

    @classmethod
    def write(cls, rec: dict) -> None:
        if cls.fh is None:
            cls.fh = open(f"{PATH}.{os.getpid()}", "a", buffering=1)
        cls.fh.write(json.dumps(rec) + "\n")


def _patch_conductor(mod) -> None:
    from mooncake.sched import admission as adm

    current: list = [None]
    orig_dispatch = mod.Conductor._dispatch
    orig_check = adm.Admission.check_plan
    orig_done = mod.Conductor._on_prefill_done

    def _dispatch(self, req):
        current[0] = (self, req)
        try:
            return orig_dispatch(self, req)
        finally:
            current[0] = None

    def count(metrics, name):
        c = getattr(metrics, name, None)
        return c._value.get() if c is not None else 0

    def check_plan(self, plan, now, evidence=(True, True)):
        probes, warmups = count(self.metrics, "admission_probes"), count(self.metrics, "admission_warmups")
        result = orig_check(self, plan, now, evidence)
        ctx = current[0]
        if plan is None or ctx is None:
            return result
        cond, req = ctx
        sched = cond.scheduler
        check = "none" if result is None else ("tbt" if result.reason == "tbt_slo" else
                                               "queue" if "queued ahead" in result.message else "best")
        probe = count(self.metrics, "admission_probes") > probes
        warm = count(self.metrics, "admission_warmups") > warmups
        q = sched.queues.get(plan.prefill.node_id)
        entries = []
        if q is not None:
            for rid, work in q.work.items():
                a = cond.attempts.get(rid)
                entries.append({"work": _f(work), "slack": _f(q.deadlines.get(rid, math.inf) - now),
                                "status": a.request.status.value if a is not None else "?",
                                "age": _f(now - a.started) if a is not None else None})
        slo = self.cfg.ttft_slo_ms / 1000
        _Out.write({
            "kind": "plan", "t": now, "req": req.req_id, "attempt": req.attempts,
            "arrived": req.arrived, "tokens": len(req.all_tokens), "max_tokens": req.sampling.max_tokens,
            "admitted": result is None, "check": check, "probe": probe, "warm_up": warm,
            "best_fail": bool(slo and plan.best_ttft_s > slo),
            "queue_fail": bool(slo and (plan.delay_ahead_s if hasattr(plan, "delay_ahead_s") else plan.est_ttft_s)
                               > plan.queue_slack_s),
            "delay_ahead": _f(getattr(plan, "delay_ahead_s", float("nan"))),
            "best_ttft": _f(plan.best_ttft_s), "est_ttft": _f(plan.est_ttft_s), "est_prefill": _f(plan.est_prefill_s),
            "queue_s": _f(plan.queue_s), "slack": _f(plan.queue_slack_s), "reserve_wait": _f(plan.reserve_wait_s),
            "est_tbt": _f(plan.est_tbt_s), "decode_batch": plan.decode_batch,
            "reusable_tokens": plan.reusable_blocks * (cond.facts.block_tokens if cond.facts else 16),
            "device_blocks": plan.device_blocks, "prefill": plan.prefill.node_id,
            "dispatch_s": _f(sched.prefill_cost.dispatch.value), "weights": [_f(w) for w in sched.prefill_cost.weights],
            "queues": {nid: [len(qq.work), _f(qq.total_s)] for nid, qq in sched.queues.items()},
            "entries": entries, "evidence": list(evidence)})
        return result

    def _on_prefill_done(self, node, msg):
        a = self.attempts.get(msg.req_id)
        rec = None
        if a is not None and a.request.status.value == "prefilling":
            req, plan, now = a.request, a.plan, time.monotonic()
            rec = {"kind": "prefilled", "t": now, "wire": msg.req_id, "req": req.req_id,
                   "est_ttft": _f(plan.est_ttft_s), "est_prefill": _f(plan.est_prefill_s), "queue_s": _f(plan.queue_s),
                   "reserve_wait": _f(plan.reserve_wait_s), "since_dispatch": _f(now - a.started),
                   "since_reserved": _f(now - a.reserved_at) if a.reserved_at else None,
                   "since_arrival": _f(now - req.arrived), "prefill_s": _f(msg.prefill_s), "fetch_s": _f(msg.fetch_s),
                   "computed": msg.computed_tokens, "cached": msg.cached_tokens, "prefill": node.node_id}
        orig_done(self, node, msg)
        if rec is not None:
            _Out.write(rec)

    mod.Conductor._dispatch = _dispatch
    adm.Admission.check_plan = check_plan
    mod.Conductor._on_prefill_done = _on_prefill_done


def _patch_runner(mod) -> None:
    orig = mod.stream_request

    async def stream_request(client, path, body, record, headers=None):
        return await orig(client, path, body, record, {**(headers or {}), "X-Request-Id": f"b{record.request_id}"})

    mod.stream_request = stream_request


_PATCHES = {"mooncake.conductor.conductor": _patch_conductor, "mooncake.bench.runner": _patch_runner}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                loader = spec.loader
                orig_exec = loader.exec_module

                def exec_module(module, _orig=orig_exec, _name=name):
                    _orig(module)
                    _PATCHES[_name](module)

                loader.exec_module = exec_module
                return spec
        return None


if PATH:
    sys.meta_path.insert(0, _Finder())
