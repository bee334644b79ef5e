"""Log-probabilities of sampled and prompt tokens (vLLM v1 ``LogprobsTensors``).

Logprobs are "raw" (vLLM's default ``logprobs_mode="raw_logprobs"``): ``log_softmax`` of
the model's logits in float32, before temperature, penalties, logit_bias, top-k/top-p or
any other processing, so they do not depend on sampling settings.

Ranks are 1-based: ``1 + #tokens with a strictly greater logprob`` (a token tied with the
maximum, such as the greedy choice, has rank 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LogprobsTensors:
    """Logprobs of N positions with the top-K alternatives.

    logprob_token_ids: int64 [N, K+1]; column 0 is the sampled (or prompt target) token,
      columns 1..K the top-K tokens, most likely first.
    logprobs: float32 [N, K+1], natural-log probabilities matching ``logprob_token_ids``.
    selected_token_ranks: int64 [N], 1-based rank of the column-0 token.
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def slice_rows(self, start: int, end: int) -> "LogprobsTensors":
        return LogprobsTensors(self.logprob_token_ids[start:end], self.logprobs[start:end],
                               self.selected_token_ranks[start:end])


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Pick the given tokens' logprobs, their ranks and the top-``num_logprobs`` tokens.

    logprobs: float32 [N, V] (already log-softmaxed). token_ids: int64 [N].
    num_logprobs: K >= 0, or -1 for the whole vocabulary (K = V).

    Raises ValueError if ``num_logprobs < -1``.
    """
    if num_logprobs < -1:
        raise ValueError(f"num_logprobs must be >= -1, got {num_logprobs}")
    V = logprobs.shape[1]
    k = V if num_logprobs == -1 else min(num_logprobs, V)
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long)
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > token_lp).sum(-1) + 1
    if k == 0:
        return LogprobsTensors(token_ids.unsqueeze(1), token_lp, ranks)
    if k == V:
        top_lp, top_ids = logprobs.sort(-1, descending=True, stable=True)
    else:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([token_lp, top_lp], dim=1),
        selected_token_ranks=ranks,
    )


def compute_sampled_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int,
                             rows: Optional[torch.Tensor] = None) -> LogprobsTensors:
    """Raw logprobs of the sampled tokens plus the top-K, for a whole step.

    raw_logits: float32 [B, V], the model's logits before any processing.
    sampled: int64 [B]. num_logprobs: K (>= 0; -1 = vocabulary).
    rows: int64 [R] rows that asked for logprobs, or None for all rows. Only those rows
      are computed; the others are filled with token 0, logprob 0 and rank 0.
    Returns LogprobsTensors with B rows.
    """
    if rows is None:
        return gather_logprobs(torch.log_softmax(raw_logits, dim=-1), sampled, num_logprobs)
    sub = gather_logprobs(torch.log_softmax(raw_logits.index_select(0, rows), dim=-1),
                          sampled.index_select(0, rows), num_logprobs)
    B, width = raw_logits.shape[0], sub.logprobs.shape[1]
    dev = raw_logits.device
    ids = torch.zeros(B, width, dtype=torch.long, device=dev).index_copy_(0, rows, sub.logprob_token_ids)
    lps = torch.zeros(B, width, dtype=torch.float32, device=dev).index_copy_(0, rows, sub.logprobs)
    ranks = torch.zeros(B, dtype=torch.long, device=dev).index_copy_(0, rows, sub.selected_token_ranks)
    return LogprobsTensors(ids, lps, ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsTensors:
    """Prompt logprobs: for each position, the logprob of the next prompt token.

    logits: [N, V] (float32; other dtypes are upcast), row ``i`` predicting
      ``target_token_ids[i]`` (int64 [N], the prompt token after position i).
    num_logprobs: K top alternatives per position (>= 0; -1 = whole vocabulary).
    Returns LogprobsTensors [N, K+1] with column 0 the target token and its rank.
    Source: vLLM v1 ``GPUModelRunner._get_prompt_logprobs_dict``.
    """
    if logits.shape[0] != target_token_ids.shape[0]:
        raise ValueError(f"logits has {logits.shape[0]} rows but target_token_ids has "
                         f"{target_token_ids.shape[0]} entries")
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_token_ids, num_logprobs)
