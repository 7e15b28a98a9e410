"""Forward-call descriptions (``Batch``) for a prefill chunk, a batched decode step and a speculative verify."""

from __future__ import annotations

from typing import Callable

import torch

from mooncake.engine.batch import Batch
from mooncake.engine.sequence import Sequence


def _tensorizer(device: torch.device) -> Callable[[list], torch.Tensor]:
    return lambda data: torch.tensor(data, dtype=torch.long, device=device)


def prefill_batch(seq: Sequence, start: int, end: int, logits: bool, T: int, device: torch.device) -> Batch:
    """Positions [start, end) of one sequence; its blocks for them are allocated."""
    S = end - start
    tensor = _tensorizer(device)
    table = seq.block_table
    pos = range(start, end)
    cols = tensor(list(pos))
    mb = -(-start // T)
    mask = None
    if start:
        mask = (torch.arange(end, device=device)[None, :] <= cols[:, None])[None, None]
    return Batch(
        ids=tensor(seq.tokens[start:end]), positions=cols, B=1, S=S,
        past_table=tensor(table[:mb])[None] if mb else None, key_len=end,
        row=torch.zeros(S, dtype=torch.long, device=device), col=cols,
        slot_block=tensor([table[p // T] for p in pos]),
        slot_offset=tensor([p % T for p in pos]),
        mask=mask, causal=start == 0 and S > 1,
        logit_rows=tensor([S - 1]) if logits else None, col0=start)


def packed_prefill_batch(parts: list[tuple[Sequence, int, int, bool]], T: int, device: torch.device) -> Batch:
    """Chunks ``(seq, start, end, logits)`` of several sequences in one row (``B == 1``): each
    sequence owns a block-aligned segment of key columns holding its blocks ``[0, ceil(end/T))``
    (past gathered from the pool, new positions written by the forward); a token sees only
    its own segment, causally. Models without sliding windows (masks by column, not position)."""
    tensor = _tensorizer(device)
    table: list[int] = []
    ids: list[int] = []
    pos: list[int] = []
    cols: list[int] = []
    lo: list[int] = []
    slot_block: list[int] = []
    logit_rows: list[int] = []
    for seq, start, end, logits in parts:
        off = len(table) * T
        table += seq.block_table[: -(-end // T)]
        ids += seq.tokens[start:end]
        pos += range(start, end)
        cols += range(off + start, off + end)
        lo += [off] * (end - start)
        slot_block += [seq.block_table[p // T] for p in range(start, end)]
        if logits:
            logit_rows.append(len(ids) - 1)
    key_len = len(table) * T
    positions, qcol, keys = tensor(pos), tensor(cols), torch.arange(key_len, device=device)
    mask = (keys[None, :] >= tensor(lo)[:, None]) & (keys[None, :] <= qcol[:, None])
    N = len(ids)
    return Batch(
        ids=tensor(ids), positions=positions, B=1, S=N, past_table=tensor(table)[None], key_len=key_len,
        row=torch.zeros(N, dtype=torch.long, device=device), col=qcol, slot_block=tensor(slot_block),
        slot_offset=positions % T, mask=mask[None, None], causal=False,
        logit_rows=tensor(logit_rows) if logit_rows else None, packed=True)


def decode_batch(seqs: list[Sequence], T: int, device: torch.device) -> Batch:
    """The last token of each sequence at position ``num_computed``; its block is allocated."""
    B = len(seqs)
    tensor = _tensorizer(device)
    ctx = [s.num_computed for s in seqs]
    rows = [s.block_table[: -(-c // T)] for s, c in zip(seqs, ctx)]
    cols = tensor(ctx)
    key_len = max(ctx) + 1
    mask = None
    if B > 1:
        mask = (torch.arange(key_len, device=device)[None, :] <= cols[:, None])[:, None, None]
    return Batch(
        ids=tensor([s.tokens[-1] for s in seqs]), positions=cols, B=B, S=1,
        past_table=None,
        key_len=key_len, row=torch.arange(B, device=device), col=cols,
        slot_block=tensor([s.block_table[c // T] for s, c in zip(seqs, ctx)]),
        slot_offset=tensor([c % T for c in ctx]),
        mask=mask, causal=False, logit_rows=torch.arange(B, device=device), col0=ctx[0],
        rows=[(s.uid, c, r) for s, c, r in zip(seqs, ctx, rows)])


def verify_batch(seqs: list[Sequence], drafts: list[list[int]], T: int, device: torch.device) -> Batch:
    """A decode step whose sequences also feed their draft tokens (``drafts[i]`` after ``seqs[i]``'s
    last token, at the next positions; their blocks are allocated): one row per new token, each on
    its sequence's decode workspace row, with logits for every row (``speculative.py``)."""
    tensor = _tensorizer(device)
    ids: list[int] = []
    pos: list[int] = []
    ws_rows: list[int] = []
    for r, (s, d) in enumerate(zip(seqs, drafts)):
        ids += [s.tokens[-1], *d]
        pos += range(s.num_computed, s.num_computed + 1 + len(d))
        ws_rows += [r] * (1 + len(d))
    cols = tensor(pos)
    N = len(ids)
    return Batch(
        ids=tensor(ids), positions=cols, B=N, S=1, past_table=None, key_len=max(pos) + 1,
        row=tensor(ws_rows), col=cols,
        slot_block=tensor([s.block_table[p // T] for s, p in zip((seqs[r] for r in ws_rows), pos)]),
        slot_offset=tensor([p % T for p in pos]), mask=None, causal=False,
        logit_rows=torch.arange(N, device=device), col0=pos[0],
        rows=[(s.uid, s.num_computed, s.block_table[: -(-s.num_computed // T)]) for s in seqs],
        ws_rows=tensor(ws_rows), row_tokens=[1 + len(d) for d in drafts])
