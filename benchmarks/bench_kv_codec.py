"""KV codecs through the served path (issue 33): what ``[model] kv_codec = "int8"`` saves against
``"none"``, each codec on a fresh cluster, one after the other in the same run.

``--part local``: a disaggregated dev cluster (1 prefill, 1 decode, 1 store; the serve defaults,
so bfloat16 on this CPU). Six requests share a ~1,300-token document (a system prompt) and ask
six different questions, greedy, 16 tokens each. Reported: KV bytes moved between roles
(``mooncake:kv_bytes_moved_total``, all paths), store bytes per block (``/cluster``: the tiers'
``used_bytes / blocks``), cached tokens per request, and how many of the six answers' first 16
tokens equal those of ``"none"``.

``--part hosts``: three network namespaces whose egress is capped with ``tc tbf`` (``--rate``,
default 50 Mbit/s): host1 the conductor, host2 a prefill (no store of its own: the store is
remote), host3 the decode and the store. (a) A fresh ``--long``-token prompt: its KV crosses
host2's capped link to the decode, which cannot produce the second token before it is in: time to
first token (the prefill's) and to the second (after the KV). (b) The same document as a cached
prefix read back from host3's store over its capped link, after other prompts pushed it out of the
prefill's device cache: the TTFT waits for the prefix.

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_codec.py \\
        [--part local|hosts|both] [--codecs none,int8] [--rate 50mbit] [--long 3000] [--model DIR] [--out FILE.md]

On a GPU host (``--model``: a model directory; the serve defaults put every engine on ``cuda``) the
local part runs the same cluster there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mooncake.config import Config, MiB, ModelConfig
from mooncake.engine.loading.loader import resolve_model_dir
from mooncake.local.machine_cluster import LocalCluster
from mooncake.security import generate_keys
from mooncake.testing.api import MODEL, metric, metrics
from mooncake.testing.hosts import Hosts
from mooncake.testing.ports import free_port
from mooncake.testing.wait import wait_for

from one_request import fresh_prompt, stream_one

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What does the conductor decide for each request?",
             "Summarize how a KV block is keyed, in two sentences.",
             "Which tiers hold KV blocks, and in what order are they evicted?",
             "How does a prefill instance hand its KV to a decode instance?",
             "What happens when a worker dies in the middle of a request?",
             "List three metrics an operator should watch, and why."]


def document(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of the project's design document, cut at a line."""
    text = (ROOT.parent / "shared" / "DESIGN.md").read_text() if (ROOT.parent / "shared").exists() else ""
    text = text or (ROOT / "README.md").read_text()
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids).rsplit("\n", 1)[0]


def chat_prompt(tokenizer, doc: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": "Answer from this document.\n\n" + doc},
                {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def moved(url: str) -> float:
    m = metrics(url)
    return sum(metric(m, "mooncake:kv_bytes_moved_total", path=p) for p in ("prefill_to_decode", "store_to_prefill"))


def store_bytes_per_block(url: str) -> float:
    nodes = httpx.get(url + "/cluster", timeout=10).json()["nodes"]
    tiers = [t for n in nodes if n["role"] == "store" for t in n["load"]["tiers"].values() if t["blocks"]]
    return sum(t["used_bytes"] for t in tiers) / max(1, sum(t["blocks"] for t in tiers))


# ---- local: a dev cluster

def run_local(codec: str, prompts: list[list[int]], model: str) -> dict:
    cfg = Config()
    cfg.model.kv_codec, cfg.model.path, cfg.model.name = codec, model, MODEL  # type: ignore[assignment]
    cfg.frontend.port = free_port()
    cfg.store.data_dir = tempfile.mkdtemp(prefix="mooncake-bench-codec-")
    cluster = LocalCluster(cfg, prefill=1, decode=1, store=1)
    cluster.start(timeout_s=300)
    try:
        texts, cached, ttft = [], [], []
        for ids in prompts:
            t0 = time.perf_counter()
            r = httpx.post(cluster.url + "/v1/completions", timeout=300,
                           json={"model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 0,
                                 "ignore_eos": True, "logprobs": 0})
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.text}")
            ttft.append(time.perf_counter() - t0)
            choice = r.json()["choices"][0]
            texts.append(choice["logprobs"]["tokens"])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        wait_for(lambda: store_bytes_per_block(cluster.url) > 0, 30, "blocks in the store")
        return {"codec": codec, "tokens": texts, "cached": cached, "moved_bytes": moved(cluster.url),
                "store_bytes_per_block": store_bytes_per_block(cluster.url), "latency_s": ttft}
    finally:
        cluster.stop()


# ---- hosts: a capped link

def run_hosts(codec: str, rate: str, doc_prompts: list[list[int]], long: int, work: Path, model: str) -> dict:
    base = Config()
    base.model.kv_codec, base.model.path, base.model.name = codec, model, MODEL  # type: ignore[assignment]
    base.engine.threads = 1
    base.conductor.store_writes = "all"  # the document reaches the store on its first request
    base.store.dram_bytes, base.store.lmdb_bytes = 512 * MiB, 0
    resolve_model_dir(base.model)
    generate_keys(work / "keys")
    base.security.curve_keys_dir = str(work / "keys")
    with Hosts(3, work, rate=rate) as hosts:
        for i, roles in {1: ["conductor"], 2: ["prefill"], 3: ["decode", "store"]}.items():
            cfg = hosts.config_for(base, i)
            cfg.store.data_dir = str(work / f"data{i}")
            if i == 2:  # room for one long prompt and a bit: the next pushes the document out
                cfg.engine.kv_cache_bytes = 80 * MiB
            for role in roles:
                hosts.spawn(i, role, cfg)
        url = f"http://{hosts[1].address}:{base.frontend.port}"

        def ready() -> bool:
            assert all(p.poll() is None for h in hosts.hosts for p in h.procs.values()), hosts.logs()
            try:
                nodes = httpx.get(url + "/health", timeout=2).json()["nodes"]
            except (httpx.HTTPError, ValueError):
                return False
            return nodes.get("prefill") == 1 and nodes.get("decode") == 1 and nodes.get("store") == 1

        wait_for(ready, 300, "the hosts' roles to register")
        sent = [fresh_prompt(999, 64), fresh_prompt(1, long), doc_prompts[0]]
        asyncio.run(stream_one(url, MODEL, sent[0], 4, codec))  # warm-up
        fresh = asyncio.run(stream_one(url, MODEL, sent[1], 4, codec))
        first = asyncio.run(stream_one(url, MODEL, sent[2], 4, codec))  # the document, written to the store
        blocks = sum(len(p) // base.engine.block_tokens for p in sent)
        wait_for(lambda: next(n for n in httpx.get(url + "/cluster", timeout=10).json()["nodes"]
                              if n["role"] == "store")["blocks_indexed"] >= blocks, 300, "the document in the store")
        asyncio.run(stream_one(url, MODEL, fresh_prompt(2, long), 1, codec))  # pushes it out of the prefill
        before = metric(metrics(url), "mooncake:kv_bytes_moved_total", path="store_to_prefill")
        hit = asyncio.run(stream_one(url, MODEL, doc_prompts[1], 4, codec))
        fetched = metric(metrics(url), "mooncake:kv_bytes_moved_total", path="store_to_prefill") - before
        logs = Path(tempfile.gettempdir()) / "bench-kv-codec-hosts" / codec  # the roles' logs, kept
        logs.mkdir(parents=True, exist_ok=True)
        for f in work.glob("*.log"):
            shutil.copy(f, logs / f.name)
    return {"codec": codec, "fresh_ttft_s": fresh.ttft_s, "fresh_second_s": fresh.ttft_s + fresh.itl_s[0],
            "doc_ttft_s": first.ttft_s, "hit_ttft_s": hit.ttft_s, "hit_fetched_bytes": fetched,
            "hit_second_s": hit.ttft_s + hit.itl_s[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["local", "hosts", "both"], default="both")
    ap.add_argument("--codecs", default="none,int8")
    ap.add_argument("--rate", default="50mbit")
    ap.add_argument("--long", type=int, default=3000, help="tokens of the fresh prompt on the capped link")
    ap.add_argument("--doc-tokens", type=int, default=1300)
    ap.add_argument("--model", default="", help="[model] path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir, _ = resolve_model_dir(ModelConfig(path=args.model))
    tok = AutoTokenizer.from_pretrained(model_dir)
    doc = document(tok, args.doc_tokens)
    prompts = [chat_prompt(tok, doc, q) for q in QUESTIONS]
    codecs = args.codecs.split(",")
    lines = [f"    {' '.join(['flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python', *sys.argv])}", ""]
    result: dict = {"prompt_tokens": [len(p) for p in prompts]}
    if args.part in ("local", "both"):
        local = {c: run_local(c, prompts, args.model) for c in codecs}
        ref = local[codecs[0]]
        lines += [f"Dev cluster (1 prefill, 1 decode, 1 store), 6 prompts of {min(map(len, prompts))}-"
                  f"{max(map(len, prompts))} tokens sharing a {args.doc_tokens}-token document, 16 greedy tokens:", "",
                  "| codec | KV bytes moved | x | store bytes/block | x | cached tokens | first 16 equal |",
                  "|---|---|---|---|---|---|---|"]
        for c in codecs:
            r = local[c]
            same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"]))
            lines.append(f"| {c} | {r['moved_bytes'] / 1e6:.1f} MB | {r['moved_bytes'] / ref['moved_bytes']:.2f} | "
                         f"{r['store_bytes_per_block']:,.0f} | "
                         f"{r['store_bytes_per_block'] / ref['store_bytes_per_block']:.2f} | "
                         f"{' '.join(map(str, r['cached']))} | {same} of {len(prompts)} |")
            r["first16_equal"] = same
        result["local"] = local
        lines.append("")
    if args.part in ("hosts", "both"):
        hosts = {}
        for c in codecs:
            with tempfile.TemporaryDirectory(prefix="mooncake-bench-codec-hosts-") as work:
                hosts[c] = run_hosts(c, args.rate, prompts, args.long, Path(work), args.model)
            print(json.dumps(hosts[c]), flush=True)
        ref = hosts[codecs[0]]
        lines += [f"Capped links ({args.rate} egress per host; prefill on host2, decode and store on host3):", "",
                  f"| codec | fresh {args.long}-token prompt: TTFT | 2nd token | x | cached document from the "
                  "remote store: TTFT | x | bytes fetched |", "|---|---|---|---|---|---|---|"]
        for c in codecs:
            r = hosts[c]
            lines.append(f"| {c} | {r['fresh_ttft_s']:.2f} s | {r['fresh_second_s']:.2f} s | "
                         f"{r['fresh_second_s'] / ref['fresh_second_s']:.2f} | {r['hit_ttft_s']:.2f} s | "
                         f"{r['hit_ttft_s'] / ref['hit_ttft_s']:.2f} | {r['hit_fetched_bytes'] / 1e6:.1f} MB |")
        result["hosts"] = hosts
    text = "\n".join(lines)
    print(text)
    print(json.dumps({k: v for k, v in result.items()}, default=str))
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
