"""Applying a step's grammar bitmask to the logits (vLLM's ``apply_grammar_bitmask``)."""
from __future__ import annotations

import torch


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                          bitmask_rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens the grammar forbids.

    logits: [N, V] (any float dtype); bitmask: int32 [R, ceil(V' / 32)] from xgrammar
    (bit t % 32 of word t // 32 set = token t allowed); rows[i] is the logits row that
    bitmask row bitmask_rows[i] constrains. Other rows are untouched, so unconstrained
    requests in the batch sample exactly as without a grammar. Uses xgrammar's fused
    kernel (~50x faster on the CPU than unpacking the bits with torch ops) on a float32
    copy of the constrained rows only."""
    if not rows:
        return
    import xgrammar as xgr

    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx).float().contiguous()
    bm = bitmask if bitmask_rows == list(range(bitmask.shape[0])) else bitmask[bitmask_rows]
    xgr.apply_token_bitmask_inplace(sub, bm.to(sub.device).contiguous())
    logits.index_copy_(0, idx, sub.to(logits.dtype))
