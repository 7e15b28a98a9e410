"""Speculative decoding (issue 54): `mooncake serve`'s default shape (one colocated instance; ``--shape pair``:
a prefill/decode pair, as ``--disaggregated``) with ``[engine] speculative`` off and ``"ngram"``, one cluster
after the other, in one run.

* **Quoting, batch 1**: chat requests whose answers quote their prompt (a paragraph repeated with one
  word changed, a function with a variable renamed; ``PROMPTS``), greedy, streamed one at a time after a
  warm-up. Per request, decode tokens/s: tokens after the first over the time from the first to the last
  streamed token; per mode, the median over ``--reps`` passes over the prompts. Greedy text must be the
  same in both modes (reported per prompt). With speculation on, the acceptance rate and tokens per verify
  step come from the ``mooncake:spec_decode_*`` counters of ``/metrics``.
* **Trace replay** (``--trace-requests`` 0: skipped): the shared trace as ``bench_e2e.py`` replays it
  (16-token blocks, at most 1,500 prompt tokens, output lengths at most 32 tokens unless
  ``--full-output``, ``--rate-scale`` times its rate), its goodput under ``bench_e2e.SLOS`` and output
  throughput: what speculation costs where prompts are not quoted (synthetic tokens: few drafts match).

Modes alternate ``--rounds`` times (off, on, off, on, ...) so that a shared machine's drift falls on both.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=benchmarks .venv/bin/python benchmarks/bench_speculative.py \\
        [--shape colocated|pair] [--reps 3] [--max-tokens 256] [--trace-requests 69] [--rate-scale 1]
        [--full-output] [--rounds 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import httpx

from bench_e2e import SLOS, TRACE, start_local
from mooncake.bench import BenchConfig, TraceScaling, run_benchmark
from mooncake.bench.client import RequestRecord, stream_request
from mooncake.config import Config
from mooncake.local.machine_cluster import LocalCluster
from mooncake.testing.api import metric
from mooncake.testing.cluster import SHAPES
from mooncake.testing.ports import free_port

MODEL = "SmolLM2-135M-Instruct"
PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. Every evening "
    "the keeper climbed the spiral stairs, lit the great lamp, and watched the ships pass safely through the "
    "narrow channel below.",
    "Our team meets every Monday at nine to review the week's plan. Each member shares what they finished, what "
    "they are working on, and anything that blocks them, and the meeting ends when every question has an owner.",
    "To make bread, mix flour, water, salt and yeast into a soft dough. Knead it for ten minutes, let it rise in "
    "a warm place for an hour, shape the loaf, and bake it in a hot oven until the crust is golden brown.",
    "The museum opens at ten in the morning and closes at six in the evening. Tickets can be bought at the main "
    "entrance, and children under twelve enter for free when they come with an adult.",
]
CODE = '''def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    return subtotal * (1 + tax)'''
PROMPTS = [
    *(f"Repeat this paragraph exactly, changing only the word '{w}' to '{v}':\n\n{p}"
      for p, (w, v) in zip(PARAGRAPHS, [("keeper", "guard"), ("Monday", "Tuesday"), ("hour", "evening"),
                                        ("ten", "nine")])),
    f"Rewrite this Python function with the variable subtotal renamed to amount. Reply with the code only.\n\n{CODE}",
]
WARM = "Repeat this sentence exactly: the cat sat on the mat."


def start(speculative: str, shape: str) -> LocalCluster:
    cfg = Config()
    cfg.frontend.port = free_port()
    cfg.store.data_dir = tempfile.mkdtemp(prefix="mooncake-speculative-")
    cfg.engine.speculative = speculative  # type: ignore[assignment]
    return start_local(cfg, **SHAPES[shape])


async def quote(url: str, text: str, max_tokens: int) -> tuple[str, RequestRecord]:
    rec = RequestRecord(0, "quote", 0, 0.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        out = await stream_request(client, "/v1/chat/completions", body, rec)
    if not rec.ok:
        raise RuntimeError(f"request failed: {rec.status} {rec.error}")
    return out, rec


async def quoting(url: str, reps: int, max_tokens: int) -> dict:
    await quote(url, WARM, 32)
    texts: dict[int, str] = {}
    tok_s: list[float] = []
    tokens = 0
    for _ in range(reps):
        for i, prompt in enumerate(PROMPTS):
            text, rec = await quote(url, prompt, max_tokens)
            texts.setdefault(i, text)
            n, decode_s = rec.completion_tokens or 0, sum(rec.itl_s)
            tokens += n
            if n > 1 and decode_s > 0:
                tok_s.append((n - 1) / decode_s)
    return {"decode_tok_s": statistics.median(tok_s), "decode_tok_s_all": tok_s, "tokens": tokens, "texts": texts}


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("verify_steps", "draft_tokens", "accepted_tokens", "emitted_tokens")
    return {n: metric(text, f"mooncake:spec_decode_{n}_total") for n in names}


async def replay(url: str, n: int, rate_scale: float, full_output: bool, salt: int) -> dict:
    scaling = TraceScaling(block_tokens=16, time_scale=0.1 / rate_scale, max_input_tokens=1500,
                           max_output_tokens=None if full_output else 32, max_requests=n, prefix_groups=3, salt=salt)
    cfg = BenchConfig(base_url=url, model=MODEL, workload="trace", trace_path=TRACE, max_requests=n, scaling=scaling,
                      goodput_slos_ms=SLOS, progress=False, label="trace", timeout_s=300)
    s = (await run_benchmark(cfg)).summary
    return {"completed": s["completed"], "errors": s["errors"], "goodput": s["goodput"],
            "output_tok_s": s["output_token_throughput"], "ttft_p50_ms": s["ttft_ms"].get("median"),
            "tpot_p50_ms": s["tpot_ms"].get("median"), "duration_s": s["duration_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="colocated")
    ap.add_argument("--reps", type=int, default=3, help="passes over the quoting prompts per mode")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--trace-requests", type=int, default=69, help="0: no trace replay")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--full-output", action="store_true", help="the trace's requests to their own output lengths")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for mode in ("off", "ngram"):
            cluster = start(mode, args.shape)
            try:
                run: dict = {"mode": mode, "round": rnd,
                             "quoting": asyncio.run(quoting(cluster.url, args.reps, args.max_tokens))}
                run["counters"] = counters(cluster.url) if mode == "ngram" else {}
                if args.trace_requests:
                    run["trace"] = asyncio.run(replay(cluster.url, args.trace_requests, args.rate_scale,
                                                      args.full_output, salt=1000 * rnd + 7 + (mode == "ngram")))
            finally:
                cluster.stop()
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "quoting"} | {
                "decode_tok_s": run["quoting"]["decode_tok_s"], "tokens": run["quoting"]["tokens"]}), flush=True)
    by = {m: [r for r in runs if r["mode"] == m] for m in ("off", "ngram")}
    med = {m: statistics.median(r["quoting"]["decode_tok_s"] for r in rs) for m, rs in by.items()}
    same = [all(a["quoting"]["texts"][i] == b["quoting"]["texts"][i] for a in by["off"] for b in by["ngram"])
            for i in range(len(PROMPTS))]
    c = by["ngram"][-1]["counters"]
    print(f"quoting, batch 1: off {med['off']:.1f} tok/s, ngram {med['ngram']:.1f} tok/s, "
          f"{med['ngram'] / med['off']:.2f}x; greedy text identical: {sum(same)}/{len(same)} prompts")
    if c.get("draft_tokens"):
        print(f"acceptance {c['accepted_tokens'] / c['draft_tokens']:.2f}, tokens per verify step "
              f"{c['emitted_tokens'] / max(1, c['verify_steps']):.2f} ({int(c['verify_steps'])} verify steps)")
    if args.trace_requests:
        good = {m: statistics.median(r["trace"]["goodput"] or 0 for r in rs) for m, rs in by.items()}
        print(f"trace replay goodput: off {good['off']:.3f}, ngram {good['ngram']:.3f} req/s "
              f"({good['ngram'] / good['off']:.2f}x)" if good["off"] else f"trace replay goodput: {good}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "identical": same}, indent=1))


if __name__ == "__main__":
    main()
