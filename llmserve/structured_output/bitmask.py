"""Applying a step's grammar bitmask to the logits (vLLM's ``apply_grammar_bitmask``)."""
from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                          bitmask_rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens the grammar forbids.

    logits: [N, V] (any float dtype); bitmask: int32 [R, ceil(V' / 32)] from xgrammar
    (bit t % 32 of word t // 32 set = token t allowed); rows[i] is the logits row that
    bitmask row bitmask_rows[i] constrains. Columns past the bitmask's width (padding of
    the logits) are forbidden too. Other rows are untouched, so unconstrained requests in
    the batch sample exactly as without a grammar."""
    if not rows:
        return
    bm = bitmask[bitmask_rows] if bitmask_rows != list(range(bitmask.shape[0])) else bitmask
    bits = (bm.unsqueeze(-1) >> _SHIFTS.to(bm.device)) & 1  # [R, W, 32]
    allowed = bits.view(bm.shape[0], -1).bool()
    V = logits.shape[1]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    allowed = allowed[:, :V]
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, idx, sub)
