"""Detokenization cost through the served path, where text never appears: the API process's CPU
for an output of special tokens only (forced with ``logit_bias``, ``skip_special_tokens``-style
text: nothing to show), for 300 and for 1,200 tokens. Linear detokenization makes the ratio ~4;
a window that never advances over ids without text makes it grow with the square (issue 30).

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_detokenize.py [--reps 3]

Starts a dev cluster (one prefill, one decode, no store); CPU from /proc of the process that
serves HTTP (utime + stime, before and after each request).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import httpx

from mooncake.testing.api import MODEL
from mooncake.testing.cluster import running_cluster


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs=2, default=[300, 1200])
    args = ap.parse_args()
    with running_cluster(Path(tempfile.mkdtemp(prefix="bench-detok-")), prefill=1, decode=1, store=0,
                         use_store=False) as c:
        api_pid = next(n["pid"] for n in httpx.get(c.url + "/cluster").json()["nodes"] if n["role"] == "frontend")
        special = httpx.post(c.url + "/tokenize", json={"model": MODEL, "prompt": "<|im_end|>",
                                                        "add_special_tokens": False}).json()["tokens"][0]
        per_length: dict[int, list[float]] = {n: [] for n in args.lengths}
        for _ in range(args.reps):
            for n in args.lengths:  # alternating, so drift hits both
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": n, "ignore_eos": True, "temperature": 0,
                        "logit_bias": {str(special): 100}, "stream": True}
                before = cpu_s(api_pid)
                with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=600) as r:
                    assert r.status_code == 200
                    text = "".join(line for line in r.iter_lines() if '"text": "' in line and '"text": ""' not in line)
                per_length[n].append(cpu_s(api_pid) - before)
                assert not text, "the output was meant to be special tokens only"
        short, long = (statistics.median(per_length[n]) for n in args.lengths)
        print(f"API process CPU, special-token-only output: {args.lengths[0]} tokens {short * 1e3:.0f} ms, "
              f"{args.lengths[1]} tokens {long * 1e3:.0f} ms (medians of {args.reps}); ratio {long / short:.2f}")


if __name__ == "__main__":
    main()
