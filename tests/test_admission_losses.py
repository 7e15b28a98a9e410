"""``benchmarks/admission_trace/losses.py`` and ``refit.py`` on constructed trace records: prompt
classes, the request a queue-check refusal protected (found by its booking time, judged by the
client's TTFT), and the cost model replayed on prefill samples."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "admission_trace"))

from losses import length_class, protected_margins  # noqa: E402


def plan(req: str, t: float, admitted: bool, check: str = "none", entries: list | None = None) -> dict:
    return {"req": req, "t": t, "admitted": admitted, "check": check, "prefill": "p0", "entries": entries or []}


def test_length_classes():
    assert length_class(89, 80) == "<256 warm"
    assert length_class(1223, 0) == ">=1024 cold"
    assert length_class(600, 100) == "256-1023 cold"


def test_the_protected_request_is_the_earliest_deadline_predicted_to_make_it():
    """Queued at the refusal (t = 10): "late" (due in 0.5 s behind 1 s of work: predicted late,
    left out) and "head" (due in 2.5 s, done at 1.5 s); the refusal protected "head", which
    took 2.4 s: a margin of 0.6 s under a 3 s SLO."""
    plans = {
        "b1-x": plan("b1-x", 9.0, True),  # booked at 9.0: age 1.0 at the refusal
        "b2-x": plan("b2-x", 9.5, True),  # booked at 9.5: age 0.5
        "b3-x": plan("b3-x", 10.0, False, "queue", [
            {"work": 1.0, "slack": 0.5, "age": 1.0},
            {"work": 0.5, "slack": 2.5, "age": 0.5},
        ]),
        "b4-x": plan("b4-x", 10.0, False, "best"),  # not the queue check: ignored
    }
    records = {1: {"ttft_s": 4.0}, 2: {"ttft_s": 2.4}}
    assert protected_margins(plans, records, 3.0) == [3.0 - 2.4]
    del records[2]  # no client record for it: nothing to judge
    assert protected_margins(plans, records, 3.0) == []


def test_refit_predicts_each_sample_before_observing_it(tmp_path: Path):
    """``refit.py``: the first sample is judged against the default prior; classes by tokens."""
    import json

    from mooncake.sched.cost_model import PrefillCostModel
    from refit import ratios, sample_class

    assert (sample_class(1223, 0), sample_class(89, 0), sample_class(9, 80)) == ("cold long", "cold short", "warm")
    rows = [{"kind": "prefilled", "req": f"b{i}-x", "t": float(i), "computed": n, "cached": c, "prefill_s": s}
            for i, (n, c, s) in enumerate([(1223, 0, 3.0), (9, 80, 0.1), (1223, 0, 3.0)])]
    (tmp_path / "trace.jsonl.1").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = ratios(str(tmp_path / "trace.jsonl"))
    assert out["cold long"][0] == 3.0 / PrefillCostModel().predict(1223, 0)
    assert len(out["cold long"]) == 2 and len(out["warm"]) == 1 and out["cold short"] == []
    assert out["cold long"][1] < out["cold long"][0]  # it learned from the first
