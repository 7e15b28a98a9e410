"""The correctness oracle: greedy decoding with the transformers model itself."""

from __future__ import annotations

import torch


def greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, never stopping at end-of-sequence (as ``ignore_eos``)."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([ids], device=model.device), use_cache=True)
        for _ in range(n):
            tok = int(step.logits[0, -1].argmax())
            out.append(tok)
            step = model(torch.tensor([[tok]], device=model.device), past_key_values=step.past_key_values, use_cache=True)
    return out
