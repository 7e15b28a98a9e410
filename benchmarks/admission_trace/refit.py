"""Replay the prefill cost model offline on the samples a traced replay fed the conductor's (the
``prefilled`` records: computed and cached tokens, the reported compute), in order, each
predicted before it is observed, starting from the default prior: realized / predicted by
prompt class. The model is whichever checkout is on ``PYTHONPATH``, so two checkouts' models
compare on the same samples:

    PYTHONPATH=CHECKOUT python benchmarks/admission_trace/refit.py TRACE_PREFIX...
"""

from __future__ import annotations

import sys

from analyze import load, pct
from mooncake.sched.cost_model import PrefillCostModel


def sample_class(computed: int, cached: int) -> str:
    return "warm" if cached else "cold long" if computed >= 1000 else "cold short"


def ratios(prefix: str) -> dict[str, list[float]]:
    """realized / predicted compute by class, over the replay's prefilled samples in time order."""
    _, done = load(prefix)
    model = PrefillCostModel()
    out: dict[str, list[float]] = {"cold long": [], "cold short": [], "warm": []}
    for d in sorted(done.values(), key=lambda d: d["t"]):
        n, ctx, seconds = d["computed"], d["cached"], d["prefill_s"]
        if n > 0 and seconds > 0:
            out[sample_class(n, ctx)].append(seconds / model.predict(n, ctx))
        model.observe(n, ctx, seconds)
    return out


if __name__ == "__main__":
    for prefix in sys.argv[1:]:
        cells = [f"{k} {pct(v, .5):.2f} ({pct(v, .1):.2f}-{pct(v, .9):.2f}, n={len(v)})" for k, v in ratios(prefix).items()]
        print(f"| {prefix} | " + " | ".join(cells) + " |")
