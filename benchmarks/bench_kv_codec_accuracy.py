"""What a lossy KV codec (``[model] kv_codec = "int8"`` or ``"fp8"``) costs in accuracy, on the
bundled SmolLM2-135M-Instruct in float32 on the CPU, against the same prompts with exact KV.

Each prompt is a chat: a passage of a document in the system turn and a question about it in the
user turn, rendered through the tokenizer's chat template. The passage is cut at the token level
so that the system turn just covers ``--prefix-tokens`` tokens (whole blocks of ``T = 16``
positions): those are the prefix a store holds, shared by the three questions on each document;
the rest (the question) is new. Per prompt and codec the served path is modelled as:

1. the prefix's KV comes from a store: every layer's K and V over the prefix is encoded and
   decoded with the codec, block by block (``[layers, 2, kv_heads, T, head_dim]`` blocks, scaled
   per block as ``mooncake/kv/codec.py`` does);
2. the new tokens are computed exactly on top of it, giving the first token (greedy);
3. the whole prompt's KV goes to a decode instance: encoded and decoded once more, block by
   block (the last, partial block padded with zeros, which leaves every absolute maximum alone);
4. decode goes on greedily (``--tokens`` in all, EOS ignored); its own new KV is exact.

The reference is the same path with no codec, i.e. plain greedy generation. Reported per codec:

- agreement@16 / agreement@N: the share of prompts whose first 16 / N tokens equal the reference's,
  and the mean length of the common prefix of the generated tokens;
- the reference's tokens teacher-forced through the codec path (steps 1-3, then one forward over
  them): the mean of log p_codec - log p_ref of those tokens and of its absolute value, in nats per
  token over all prompts and positions;
- the codec's own error: one encode + decode of each prompt's exact KV (all positions, all layers
  at once, as an engine does), as ||decoded - exact|| / ||exact|| over all prompts, and its
  milliseconds per prompt; and the bytes of one encoded block (float32's for scale).

Documents are the project's own (README.md, /work/shared/DESIGN.md and seeds), read from disk,
so the run is deterministic and needs nothing downloaded. Takes about 4 minutes with 2 threads:

    flock /tmp/mooncake-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/bench_kv_codec_accuracy.py [--prompts 12]
          [--tokens 64] [--codecs int8,fp8] [--prefix-tokens 1280] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mooncake.bench.publish import publish
from mooncake.config import ModelConfig
from mooncake.engine.loading.loader import load_model
from mooncake.kv.codec import KVCodec

BLOCK_TOKENS = 16  # EngineConfig.block_tokens' default
QUESTIONS_PER_DOCUMENT = 3
ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
# (file, text the passage starts at): prose first, past any page furniture; missing files are skipped
DOCUMENTS = (
    (SHARED / "DESIGN.md", "A KVCache-centric"),
    (SHARED / "seeds" / "000_25822045081527f8.txt", "Mooncake reports"),
    (ROOT / "README.md", "A KV-cache-centric"),
    (SHARED / "seeds" / "001_e783760efe220152.txt", "Mooncake is a KVCache-centric"),
    (SHARED / "seeds" / "003_48466bc8528f376d.txt", "Most LLM serving"),
    (ROOT / "BENCHMARKS.md", ""),
)
QUESTIONS = (
    "Summarize the main idea of this document in three sentences.",
    "What problem does the system described here solve, and how does it solve it?",
    "List the main components the document mentions and say what each one does.",
    "What trade-offs or limitations does the document point out?",
    "Explain to a new engineer how one request flows through the system described above.",
    "Which numbers does the document give, and what do they show?",
)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, seq, head_dim]


@dataclass
class Prompt:
    """One chat prompt: its document's file name and its token ids."""
    document: str
    ids: list[int]  # the whole prompt; ids[:prefix] is the document's shared, cached prefix


@dataclass
class PathRun:
    """One prompt through the served path (steps 1-4 of the module docstring)."""
    tokens: list[int]
    first_logits: torch.Tensor  # step 2's logits of the first generated token
    handoff: torch.Tensor  # step 3's result: the KV decode starts from, [layers, 2, heads, seq, dim]


@dataclass
class CodecStats:
    """Sums over prompts for one codec."""
    common: list[int] = field(default_factory=list)  # per prompt: tokens in common with the reference
    logp_diff: list[torch.Tensor] = field(default_factory=list)
    sq_err: float = 0.0
    sq_norm: float = 0.0
    codec_ms: list[float] = field(default_factory=list)

    def summary(self, codec: KVCodec, points: list[int]) -> dict[str, float]:
        """The reported figures; ``agree@k`` for each of ``points``."""
        diff = torch.cat(self.logp_diff)
        count = len(self.common)
        agree = {f"agree@{k}": sum(c >= k for c in self.common) / count for k in points}
        return {**agree, "common_prefix": sum(self.common) / count, "logp_diff_mean": float(diff.mean()),
                "logp_diff_abs_mean": float(diff.abs().mean()), "kv_rel_err": (self.sq_err / self.sq_norm) ** 0.5,
                "codec_ms": sum(self.codec_ms) / count, "block_bytes": codec.wire_block_bytes,
                "block_vs_float32": codec.wire_block_bytes / (math.prod(codec.block_shape) * 4)}


def passage_start(text: str, marker: str) -> str:
    """``text`` from the first occurrence of ``marker`` (all of it when absent)."""
    return text[max(text.find(marker), 0):]


def render(tokenizer, document: str, question: str | None) -> list[int]:
    """Token ids of the chat (system: ``document``; user: ``question``, then the assistant's turn
    opens), rendered and tokenized as the frontend does; without ``question``: the system turn alone."""
    turns = [{"role": "system", "content": document}]
    if question is not None:
        turns.append({"role": "user", "content": question})
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=question is not None)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompts(tokenizer, count: int, prefix: int) -> list[Prompt]:
    """``count`` prompts, ``QUESTIONS_PER_DOCUMENT`` per document: the document is cut at the token
    level so that its system turn just covers ``prefix`` tokens, which its prompts then share."""
    documents = [(path, passage_start(path.read_text(errors="replace"), marker))
                 for path, marker in DOCUMENTS if path.is_file()]
    prompts: list[Prompt] = []
    for d, (path, text) in enumerate(documents):
        if len(prompts) == count:
            break
        doc_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = prefix - 8
        while cut <= len(doc_ids) and len(render(tokenizer, tokenizer.decode(doc_ids[:cut]), None)) < prefix:
            cut += 1
        if cut > len(doc_ids):
            continue  # too short for this prefix
        passage = tokenizer.decode(doc_ids[:cut])
        for j in range(min(QUESTIONS_PER_DOCUMENT, count - len(prompts))):
            question = QUESTIONS[(QUESTIONS_PER_DOCUMENT * d + j) % len(QUESTIONS)]
            prompts.append(Prompt(path.name, render(tokenizer, passage, question)))
    if len(prompts) < count:
        raise SystemExit(f"only {len(prompts)} prompts of a {prefix}-token prefix from the documents on this machine")
    return prompts


def stack(kv: KV) -> torch.Tensor:
    """Per-layer ``[1, H, S, D]`` keys and values as one ``[layers, 2, H, S, D]`` tensor."""
    return torch.stack([torch.stack((k[0], v[0])) for k, v in kv])


def unstack(kv: torch.Tensor) -> KV:
    """The inverse of ``stack``."""
    return [(layer[0][None], layer[1][None]) for layer in kv]


def round_trip(codec: KVCodec | None, kv: torch.Tensor) -> torch.Tensor:
    """``[layers, 2, H, S, D]`` KV encoded and decoded block by block (``T`` positions per block, a
    partial last block zero-padded); no codec: ``kv``."""
    if codec is None:
        return kv
    *lead, seq, dim = kv.shape
    blocks = -(-seq // BLOCK_TOKENS)
    padded = F.pad(kv, (0, 0, 0, blocks * BLOCK_TOKENS - seq)).view(*lead, blocks, BLOCK_TOKENS, dim)
    return codec.decode(codec.encode(padded)).view(*lead, blocks * BLOCK_TOKENS, dim)[..., :seq, :]


def forward(model, ids: list[int], cache: DynamicCache, keep: int) -> torch.Tensor:
    """Logits ``[keep, vocab]`` of the last ``keep`` of ``ids`` computed on top of ``cache`` (which grows)."""
    return model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=keep).logits[0]


def new_cache(model, kv: torch.Tensor) -> DynamicCache:
    """A fresh cache holding (a copy of) ``[layers, 2, H, S, D]`` KV."""
    return DynamicCache(ddp_cache_data=unstack(kv), config=model.config)


def served_path(model, prefix_kv: torch.Tensor, suffix: list[int], codec: KVCodec | None, n: int) -> PathRun:
    """Steps 1-4 for one prompt whose exact prefix KV is ``prefix_kv``; ``n`` greedy tokens."""
    cache = new_cache(model, round_trip(codec, prefix_kv))
    first_logits = forward(model, suffix, cache, 1)[-1]
    handoff = round_trip(codec, stack([(layer.keys, layer.values) for layer in cache.layers]))
    tokens = [int(first_logits.argmax())]
    decode_cache = new_cache(model, handoff)
    while len(tokens) < n:
        tokens.append(int(forward(model, tokens[-1:], decode_cache, 1)[-1].argmax()))
    return PathRun(tokens, first_logits, handoff)


def teacher_forced(model, run: PathRun, tokens: list[int]) -> torch.Tensor:
    """log p of each of ``tokens`` (the reference's) when they follow ``run``'s step 3 KV."""
    rest = forward(model, tokens[:-1], new_cache(model, run.handoff), len(tokens) - 1)
    logp = torch.cat((run.first_logits[None], rest)).log_softmax(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement_points(tokens: int) -> list[int]:
    """The prefix lengths agreement is reported at: 16 and all ``tokens``."""
    return sorted({min(16, tokens), tokens})


def run(args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], list[Prompt], float]:
    """Every prompt through the reference and each codec; per-codec summaries, the prompts, seconds."""
    loaded = load_model(ModelConfig(dtype="float32", device="cpu"))
    model, cfg = loaded.hf_model, loaded.hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, BLOCK_TOKENS, head_dim)
    codecs = {name: KVCodec(name, block_shape, torch.float32) for name in args.codecs}
    prompts = build_prompts(loaded.tokenizer, args.prompts, args.prefix_tokens)
    stats = {name: CodecStats() for name in codecs}
    start = time.perf_counter()
    prefix_ids: list[int] = []
    for i, prompt in enumerate(prompts):
        if prompt.ids[:args.prefix_tokens] != prefix_ids:  # a new document: compute its prefix once
            prefix_ids = prompt.ids[:args.prefix_tokens]
            cache = DynamicCache(config=cfg)
            forward(model, prefix_ids, cache, 1)
            prefix_kv = stack([(layer.keys, layer.values) for layer in cache.layers])
        suffix = prompt.ids[args.prefix_tokens:]
        ref = served_path(model, prefix_kv, suffix, None, args.tokens)
        ref_logp = teacher_forced(model, ref, ref.tokens)
        exact = ref.handoff.double()  # the whole prompt's KV, exact
        exact_sq = float(exact.square().sum())
        line = [f"prompt {i + 1}/{len(prompts)} ({prompt.document}, {len(prompt.ids)} tokens)"]
        for name, codec in codecs.items():
            got = served_path(model, prefix_kv, suffix, codec, args.tokens)
            s = stats[name]
            common = common_prefix(got.tokens, ref.tokens)
            s.common.append(common)
            s.logp_diff.append(teacher_forced(model, got, ref.tokens) - ref_logp)
            took = time.perf_counter()
            decoded = round_trip(codec, ref.handoff)
            s.codec_ms.append((time.perf_counter() - took) * 1000)
            s.sq_err += float((decoded.double() - exact).square().sum())
            s.sq_norm += exact_sq
            line.append(f"{name}: common {common}, mean dlogp {float(s.logp_diff[-1].mean()):+.4f}")
        print("; ".join(line), file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    points = agreement_points(args.tokens)
    return {name: stats[name].summary(codec, points) for name, codec in codecs.items()}, prompts, elapsed


def table(results: dict[str, dict[str, float]], args: argparse.Namespace, prompts: list[Prompt],
          elapsed: float) -> str:
    """The results as markdown, with the setup and the command line."""
    points = agreement_points(args.tokens)
    documents = ", ".join(dict.fromkeys(p.document for p in prompts))
    mean_len = sum(len(p.ids) for p in prompts) / len(prompts)
    head = [*(f"agree@{k}" for k in points), "common prefix (tokens)", "mean Δlog p (nats/token)",
            "mean \\|Δlog p\\| (nats/token)", "KV rel. error", "encode+decode (ms/prompt)", "bytes/block (vs float32)"]
    lines = [f"KV codec accuracy: SmolLM2-135M-Instruct, float32, CPU ({torch.get_num_threads()} threads); "
             f"{len(prompts)} prompts (mean {mean_len:.0f} tokens, cached prefix {args.prefix_tokens}, "
             f"blocks of {BLOCK_TOKENS}; documents: {documents}), {args.tokens} greedy tokens each; "
             f"against exact KV; {elapsed:.0f} s",
             "", "| codec | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for name, r in results.items():
        cells = [*(f"{r[f'agree@{k}']:.3f}" for k in points), f"{r['common_prefix']:.1f}",
                 f"{r['logp_diff_mean']:+.5f}", f"{r['logp_diff_abs_mean']:.5f}", f"{r['kv_rel_err']:.5f}",
                 f"{r['codec_ms']:.1f}", f"{r['block_bytes']:,} ({r['block_vs_float32']:.2f}x)"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{shlex.join(sys.orig_argv)}`"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt (EOS ignored)")
    ap.add_argument("--codecs", type=lambda s: [c for c in s.split(",") if c], default=["int8", "fp8"],
                    help="comma-separated kv codecs to compare against exact KV (none: a sanity check)")
    ap.add_argument("--prefix-tokens", type=int, default=1280,
                    help=f"cached prefix per prompt, a multiple of {BLOCK_TOKENS}")
    ap.add_argument("--out", help="write the markdown table here too")
    args = ap.parse_args()
    if args.prefix_tokens <= 0 or args.prefix_tokens % BLOCK_TOKENS:
        ap.error(f"--prefix-tokens must be a positive multiple of {BLOCK_TOKENS}")
    if args.prompts < 1 or args.tokens < 2 or not args.codecs:
        ap.error("--prompts must be at least 1, --tokens at least 2, --codecs non-empty")
    torch.set_num_threads(2)
    with torch.inference_mode():
        results, prompts, elapsed = run(args)
    publish(table(results, args, prompts, elapsed), args.out)
    print(json.dumps({"bench": "kv_codec_accuracy", "prompts": len(prompts), "tokens": args.tokens,
                      "prefix_tokens": args.prefix_tokens, "block_tokens": BLOCK_TOKENS,
                      "elapsed_s": round(elapsed, 1), "codecs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
