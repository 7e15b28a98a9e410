"""The engine: sequences over a paged KV cache, computed by its own forward, for prefill and
decode roles. KV import / export is ``engine.kv`` (``mooncake.kv.pool_io``); choosing next tokens,
``token_picker``.

Not thread-safe: the roles call one Engine from a single worker thread. Compute
is synchronous.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Callable

import torch

from mooncake.blocks import BlockHash, extend_chain, hash_blocks, root_hash
from mooncake.config import EngineConfig
from mooncake.engine.batching import decode_batch, packed_prefill_batch, prefill_batch
from mooncake.engine.constraints import consume
from mooncake.engine.model.decoder import DecoderForward
from mooncake.engine.host_memory import keep_freed_memory
from mooncake.engine.kv_cache import BlockManager, allocate_pool
from mooncake.engine.loading.loader import LoadedModel
from mooncake.engine.request_checks import check_request
from mooncake.engine.sampler import sequence_seed
from mooncake.engine.sequence import PrefillStep, Sequence, StepOutput
from mooncake.engine.speculative import speculation_for
from mooncake.engine.token_picker import TokenPicker
from mooncake.kv.codec import KVCodec
from mooncake.kv.layers import ChunkLayers, LayerFn, LayerHooks
from mooncake.kv.pool_io import PoolKV
from mooncake.protocol import Sampling
from mooncake.sched.request_class import FLEX_RANK, rank


class Engine:
    """One model on one device with a paged KV pool. Not thread-safe."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, session_blocks_per_key: int = 0,
                 session_share_per_key: float = 0.0) -> None:
        """``session_blocks_per_key``, ``session_share_per_key``: what one tenant's sessions may keep (``[classes]``)."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        config = loaded.hf_model.config
        self.model_id = loaded.model_id
        self.block_tokens = T = cfg.block_tokens
        model_len = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.max_model_len = min(cfg.max_model_len, model_len) if cfg.max_model_len else model_len
        self.model = DecoderForward(loaded.hf_model, self.max_model_len, T, loaded.quantization, cfg.native_kernels,
                                    cfg.int4_activations, loaded.gguf)
        self.dtype, self.device = self.model.dtype, self.model.device
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse freed memory instead of faulting in fresh pages
        self.block_shape = self.model.block_shape
        self.block_bytes = math.prod(self.block_shape) * torch.empty(0, dtype=self.dtype).element_size()
        self.num_blocks = cfg.kv_cache_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError("kv_cache_bytes %d holds no block of %d bytes" % (cfg.kv_cache_bytes, self.block_bytes))
        self.pool = allocate_pool(self.num_blocks, self.block_shape, self.dtype, self.device)
        self.on_block_event: Callable[[str, list[BlockHash]], None] | None = None
        self.blocks = BlockManager(self.num_blocks, lambda: self.on_block_event,
                                   session_blocks_per_key=session_blocks_per_key,
                                   session_share_per_key=session_share_per_key)
        # KV into and out of the pool, encoded outside it ([model] kv_codec)
        self.kv = PoolKV(self.pool, self.blocks, self.model, KVCodec(loaded.kv_codec, self.block_shape, self.dtype))
        self.kv_block_bytes = self.kv.codec.wire_block_bytes  # one block as it travels and is stored
        self.vocab_size = int(self.model.embed.shape[0])
        self.picker = TokenPicker(loaded, self.vocab_size, self.max_model_len, cfg.threads or 1)
        self.chunk_tokens = cfg.prefill_chunk_tokens
        self.prefix_caching = cfg.prefix_caching
        self.max_batch = cfg.max_batch
        self.speculation = speculation_for(cfg, self.model, self.pool, self.blocks, self.picker, self.register_full,
                                           self.max_model_len)  # None: off
        self._num_seqs = 0
        self._uids = itertools.count(1)

    # ------------------------------------------------------------ requests

    def hashes(self, tokens: list[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The chain of ``tokens`` (roles get it from the conductor; this is for direct use)."""
        return hash_blocks(tokens, self.block_tokens, self.model_id, cache_salt)

    def root(self, cache_salt: str | None = None) -> BlockHash:
        return root_hash(self.model_id, cache_salt)

    def validate(self, tokens: list[int], sampling: Sampling) -> None:
        """Raise InvalidRequestError (user-facing message, ``param``) for a request we cannot serve."""
        check_request(tokens, sampling, self.max_model_len, self.vocab_size)

    def cached_prefix(self, hashes: list[BlockHash]) -> int:
        return self.blocks.cached_prefix(hashes) if self.prefix_caching else 0

    def add_sequence(self, req_id: str, tokens: list[int], sampling: Sampling, cache_salt: str | None = None,
                     num_generated: int = 0, hashes: list[BlockHash] | None = None,
                     root: BlockHash | None = None, max_cached_blocks: int | None = None) -> Sequence | None:
        """Attach the longest cached prefix (at most ``max_cached_blocks``) and allocate the prompt's
        other blocks; None if the pool cannot hold it (nothing is leaked). ``hashes``/``root``: the
        prompt's chain, when the caller has it (else computed from ``cache_salt``)."""
        self.validate(tokens, sampling)
        root = self.root(cache_salt) if root is None else root
        hashes = self.hashes(tokens, cache_salt) if hashes is None else list(hashes)
        n_hit = min(self.cached_prefix(hashes), (len(tokens) - 1) // self.block_tokens,
                    len(hashes) if max_cached_blocks is None else max_cached_blocks)
        return self._new_sequence(req_id, tokens, sampling, num_generated, hashes, root, n_hit, True)

    def reserve(self, req_id: str, tokens: list[int], hashes: list[BlockHash], root: BlockHash,
                sampling: Sampling, num_generated: int = 0) -> Sequence | None:
        """Hold the blocks for a sequence whose KV for ``tokens`` will be written in by
        ``kv.write_kv``; leading blocks already cached are shared (their KV need not come).
        None if the pool cannot hold it now (nothing is leaked)."""
        self.validate(tokens, sampling)
        return self._new_sequence(req_id, tokens, sampling, num_generated, list(hashes), root,
                                  self.blocks.cached_prefix(hashes), False)

    def _new_sequence(self, req_id: str, tokens: list[int], sampling: Sampling, num_generated: int,
                      hashes: list[BlockHash], root: BlockHash, n_hit: int, computes: bool) -> Sequence | None:
        """A sequence sharing the cached blocks ``hashes[:n_hit]`` and holding new ones for the rest of
        ``tokens``; None if the pool cannot hold it (nothing is leaked). ``computes``: the engine computes
        the rest (the shared prefix counts as computed); else the KV of all ``tokens`` will be written in."""
        matcher = self.picker.matcher(tokens, sampling, num_generated)
        flex = rank(sampling) == FLEX_RANK  # its blocks are evicted before other requests'
        held = self.blocks.acquire(hashes[:n_hit], flex)
        new = self.blocks.allocate(-(-len(tokens) // self.block_tokens) - n_hit, flex)
        if new is None:
            self.blocks.release(held)
            return None
        self._num_seqs += 1
        cached = n_hit * self.block_tokens
        return Sequence(req_id, list(tokens), sampling, root, cached, cached if computes else 0, num_generated,
                        held + new, list(hashes[:n_hit]) if computes else [], seed=sequence_seed(sampling),
                        hashes=hashes, uid=next(self._uids), matcher=matcher)

    def begin_decoding(self, seq: Sequence, next_token: int) -> None:
        """All of a reserved sequence's KV is in: it decodes ``next_token`` next."""
        T = self.block_tokens
        n_hit = seq.num_cached_tokens // T
        full = len(seq.tokens) // T
        self.blocks.register(seq.block_table[n_hit:full], seq.hashes[n_hit:full])
        seq.block_hashes = list(seq.hashes[:full])
        seq.num_computed = len(seq.tokens)
        if seq.matcher is not None:
            consume(seq.matcher, next_token)
        seq.tokens.append(next_token)
        seq.num_generated += 1
        seq.prefilled = True

    def blocks_needed(self, seqs: list[Sequence]) -> int:
        """Blocks the next decode step of ``seqs`` allocates (those at a block boundary)."""
        T = self.block_tokens
        return sum(1 for s in seqs if s.prefilled and not s.finished and not s.freed
                   and s.num_computed // T >= len(s.block_table))

    def free(self, seq: Sequence) -> None:
        """Hashed full blocks stay cached (LRU; a session's kept ``keep_s``); the rest return to the
        pool. Idempotent."""
        if seq.freed:
            return
        self.blocks.release(seq.block_table, seq.sampling.keep_s, seq.sampling.tenant)
        seq.block_table = []
        seq.freed = True
        self._num_seqs -= 1

    # ------------------------------------------------------------ compute

    def prefill(self, seq: Sequence, on_layer: LayerFn | None = None,
                past_ready: Callable[[int], None] | None = None, chunk_tokens: int | None = None) -> PrefillStep:
        """Compute the next chunk of the prompt (``chunk_tokens``, default ``prefill_chunk_tokens``);
        sample the first token after the last one.
        ``on_layer(layer, first_block, kv)``: each layer's K/V of the blocks this chunk completes,
        as soon as the layer has computed them (``mooncake/kv/layers.py``; on this thread). ``past_ready(layer)``:
        blocks until that layer of the sequence's past is in the pool (a prefix loading layer by layer,
        ``kv.land_layers``); may raise, which abandons the chunk with nothing written."""
        if seq.prefilled or seq.freed:
            raise RuntimeError("sequence %s is not waiting for prefill" % seq.req_id)
        t0 = time.perf_counter()
        start, n = seq.num_computed, len(seq.tokens)
        end = min(n, start + (chunk_tokens or self.chunk_tokens))
        hook = ChunkLayers(on_layer, start, end, end == n, self.block_tokens) if on_layer is not None else None
        hooks = None if hook is None and past_ready is None else LayerHooks(on_layer=hook, past_ready=past_ready)
        logits = self.model.forward(self.pool, prefill_batch(seq, start, end, end == n, self.block_tokens, self.device),
                                    hooks)
        seq.num_computed = end
        full = self.register_full(seq, start, end)
        if end < n:
            return PrefillStep(full, False, compute_s=time.perf_counter() - t0)
        seq.prefilled = True
        assert logits is not None
        picked = self.picker.sample(logits, [seq])
        token = picked.tokens[0]
        return PrefillStep(full, True, token, self.picker.append(seq, token), logits[0], picked.logprobs[0],
                           compute_s=time.perf_counter() - t0)

    def prefill_stage(self, seq: Sequence, layers: tuple[int, int], end: int, hidden: torch.Tensor | None = None,
                      on_layer: LayerFn | None = None) -> tuple[PrefillStep, torch.Tensor | None]:
        """One pipeline stage's part of a prefill chunk: positions ``[num_computed, end)`` through
        ``layers = (lo, hi)`` only, on the previous stage's ``hidden`` states (``lo > 0``). Returns the
        step and this stage's hidden states ``[end - start, hidden]`` for the next stage (None from the
        last stage, which samples the first token after the prompt's last chunk). A stage writes only
        its own layers' K/V, so its blocks are never keyed for reuse (the prefix cache holds whole blocks)."""
        if seq.prefilled or seq.freed:
            raise RuntimeError("sequence %s is not waiting for prefill" % seq.req_id)
        lo, hi = layers
        start, n = seq.num_computed, len(seq.tokens)
        if not (0 <= lo < hi <= self.block_shape[0]) or not start < end <= n:
            raise ValueError("stage layers %d..%d, positions %d..%d do not fit sequence %s (%d computed of %d)"
                             % (lo, hi, start, end, seq.req_id, start, n))
        if lo > 0 and (hidden is None or hidden.dim() != 2 or hidden.shape[0] != end - start
                       or hidden.shape[1] != self.model.embed.shape[1]):
            raise ValueError("stage input for positions %d..%d must be [%d, %d] hidden states"
                             % (start, end, end - start, self.model.embed.shape[1]))
        last, final = end == n, hi == self.block_shape[0]
        hook = ChunkLayers(on_layer, start, end, last, self.block_tokens) if on_layer is not None else None
        batch = prefill_batch(seq, start, end, last and final, self.block_tokens, self.device)
        out = self.model.forward(self.pool, batch, LayerHooks(on_layer=hook, layers=layers, hidden=hidden))
        seq.num_computed = end
        if not final:
            return PrefillStep([], last), out
        if not last:
            return PrefillStep([], False), None
        seq.prefilled = True
        assert out is not None
        picked = self.picker.sample(out, [seq])
        token = picked.tokens[0]
        return PrefillStep([], True, token, self.picker.append(seq, token), out[0], picked.logprobs[0]), None

    def prefill_many(self, seqs: list[Sequence], hooks: list[LayerFn | None] | None = None,
                     chunk_tokens: int | None = None) -> list[PrefillStep]:
        """``prefill`` for several sequences in one forward: the chunk budget
        (``chunk_tokens``, default ``prefill_chunk_tokens``) is shared in order, so a burst of short prompts computes
        together instead of one after another. A sequence left without budget makes no
        progress this call (its step is not done, no new blocks). Models with sliding
        windows compute the sequences one by one within the same shared budget; sequences with
        per-layer KV hooks (``hooks``, layer-wise transfer: the hook reads one sequence's
        workspace) one by one, a whole chunk each."""
        for s in seqs:
            if s.prefilled or s.freed:
                raise RuntimeError("sequence %s is not waiting for prefill" % s.req_id)
        if hooks is not None and any(h is not None for h in hooks):
            return [self.prefill(s, h, chunk_tokens=chunk_tokens) for s, h in zip(seqs, hooks)]
        budget = chunk_tokens or self.chunk_tokens
        if len(seqs) == 1 or self.model.windows != {None}:
            steps = []
            for s in seqs:
                start = s.num_computed
                steps.append(self.prefill(s, chunk_tokens=budget) if budget > 0 else PrefillStep([], False))
                budget -= s.num_computed - start
            return steps
        parts: list[tuple[Sequence, int, int, bool]] = []
        for s in seqs:
            start, n = s.num_computed, len(s.tokens)
            end = min(n, start + budget)
            if end > start:
                parts.append((s, start, end, end == n))
                budget -= end - start
        if len(parts) == 1:
            return [self.prefill(s, chunk_tokens=chunk_tokens) if s is parts[0][0] else PrefillStep([], False)
                    for s in seqs]
        t0 = time.perf_counter()
        logits = self.model.forward(self.pool, packed_prefill_batch(parts, self.block_tokens, self.device))
        steps: dict[int, PrefillStep] = {}
        finishing: list[Sequence] = []
        for s, start, end, last in parts:
            s.num_computed = end
            steps[id(s)] = PrefillStep(self.register_full(s, start, end), False)
            if last:
                finishing.append(s)
        if finishing:
            assert logits is not None
            picked = self.picker.sample(logits, finishing)
            for i, (s, tok) in enumerate(zip(finishing, picked.tokens)):
                s.prefilled = True
                full = steps[id(s)].new_full_blocks
                steps[id(s)] = PrefillStep(full, True, tok, self.picker.append(s, tok), logits[i], picked.logprobs[i])
        per_token = (time.perf_counter() - t0) / sum(end - start for _, start, end, _ in parts)
        for s, start, end, _ in parts:  # each sequence's share of the forward, by its tokens
            steps[id(s)].compute_s = per_token * (end - start)
        return [steps.get(id(s), PrefillStep([], False)) for s in seqs]

    def decode_step(self, seqs: list[Sequence]) -> list[StepOutput]:
        """One token for each sequence, batched (``max_batch`` at a time). A sequence that cannot
        get a block for its next position gets token None and is left intact."""
        out: dict[int, StepOutput] = {}
        ready: list[Sequence] = []
        T = self.block_tokens
        for s in seqs:
            if s.finished or s.freed or not s.prefilled:
                out[id(s)] = StepOutput(s, None, s.finished)
                continue
            if s.num_computed // T >= len(s.block_table):
                got = self.blocks.allocate(1, rank(s.sampling) == FLEX_RANK)
                if got is None:
                    out[id(s)] = StepOutput(s, None, "")
                    continue
                s.block_table.extend(got)
            ready.append(s)
        verified = self.speculation.step(seqs, ready, out) if self.speculation is not None and ready else None
        if verified is not None:
            return verified
        for i in range(0, len(ready), self.max_batch):
            part = ready[i: i + self.max_batch]
            logits = self.model.forward(self.pool, decode_batch(part, self.block_tokens, self.device))
            assert logits is not None
            picked = self.picker.sample(logits, part)
            for s, tok, lp in zip(part, picked.tokens, picked.logprobs):
                s.num_computed += 1
                if s.num_computed % T == 0:
                    self.register_full(s, s.num_computed - 1, s.num_computed)
                out[id(s)] = StepOutput(s, tok, self.picker.append(s, tok), lp)
        return [out[id(s)] for s in seqs]

    def register_full(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Key the blocks that became full while computing positions [start, end)."""
        T = self.block_tokens
        idx = list(range(start // T, end // T))
        if not idx:
            return idx
        known = len(seq.hashes)
        if known < idx[-1] + 1:  # blocks past the known chain (generated tokens): extend it
            seq.hashes += extend_chain(seq.hashes[-1] if known else seq.root, seq.tokens[known * T:(idx[-1] + 1) * T], T)
        hs = [seq.hashes[j] for j in idx]
        seq.block_hashes.extend(hs)
        self.blocks.register([seq.block_table[j] for j in idx], hs)
        return idx

    def stats(self) -> dict:
        """cached_blocks: unreferenced, evictable cached blocks (flex_cached_blocks of them held only
        by flex requests, session_cached_blocks kept for a session now); used_blocks: referenced ones (free + cached + used == num_blocks);
        prefix_blocks: all keyed blocks; evicted_blocks: cached blocks evicted, by segment; kept_by_tenant: blocks
        kept per tenant (those in use that a session keeps once released too); speculative: speculative decoding's
        totals (``speculative.SpeculativeCounts``; empty when off). Read-only: it
        runs on the event loop while the engine thread changes the blocks (sessions expire on the
        engine thread, as blocks are allocated)."""
        return {"num_blocks": self.num_blocks, "free_blocks": len(self.blocks.free),
                "cached_blocks": self.blocks.num_cached(), "flex_cached_blocks": len(self.blocks.flex_lru),
                "session_cached_blocks": len(self.blocks.session_lru),
                "used_blocks": self.blocks.num_referenced(), "prefix_blocks": len(self.blocks.cached),
                "sequences": self._num_seqs, "evicted_blocks": dict(self.blocks.evicted),
                "kept_by_tenant": self.blocks.keepers.counts(),
                "speculative": self.speculation.drafter.counts.as_dict() if self.speculation is not None else {}}
