"""``Batch``: the tensors describing one forward call (built by ``batching``, read by the decoder)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Tensors describing one forward call (built by the engine)."""

    ids: torch.Tensor  # [B*S] input token ids
    positions: torch.Tensor  # [B*S]
    B: int
    S: int
    past_table: torch.Tensor | None  # [B, Mb] pool blocks holding the past (padded), None: no past
    key_len: int  # keys attended: max over rows of past + S
    row: torch.Tensor  # [B*S] batch row of each new token (workspace write index)
    col: torch.Tensor  # [B*S] key position of each new token (workspace write index)
    slot_block: torch.Tensor  # [B*S] pool block of each new token
    slot_offset: torch.Tensor  # [B*S] offset in that block
    mask: torch.Tensor | None  # [B, 1, S, key_len] bool (True = attend) or None
    causal: bool  # B == 1, no past, S > 1: plain causal attention
    logit_rows: torch.Tensor | None  # rows of [B*S] whose logits are wanted; None: none
    col0: int = 0  # B == 1: key position of the first new token
    rows: list[tuple[int, int, list[int]]] | None = None  # decode: (seq uid, past length, past blocks)
    packed: bool = False  # B == 1 holding several sequences' chunks side by side (block-diagonal mask)
    ws_rows: torch.Tensor | None = None  # speculative verify: [B] the decode workspace row of each new token
    row_tokens: list[int] | None = None  # speculative verify: new tokens per workspace row (``rows``)
