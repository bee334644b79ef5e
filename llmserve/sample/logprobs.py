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


_LOG2E = 1.4426950408889634
CHUNK = 64  # chunk width for the two-stage reductions here and in sampler.py


def chunkable(x: torch.Tensor, min_chunks: int = 16) -> bool:
    """True when [n, V] ``x`` can be viewed as [n, V/64, 64] chunks and that is worth it
    (CPU tensors: the two-stage kernels beat PyTorch's single-pass CPU argmax/topk)."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[1] % CHUNK == 0
            and x.shape[1] >= min_chunks * CHUNK and x.is_contiguous())


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` for a [n, V] tensor and int64 [m] row indices, as a new contiguous
    [m, V] tensor. On the CPU, stacking row views is several times faster than
    ``index_select`` / advanced indexing for wide rows."""
    if x.device.type != "cpu":
        return x.index_select(0, rows)
    if rows.numel() == 0:
        return x[:0].clone()
    return torch.stack([x[i] for i in rows.tolist()])


def _order_keys(vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort like (value desc, index asc) when sorted descending.

    High 32 bits: the float32 bit pattern made order-preserving as a signed int (negative
    floats have their magnitude bits flipped); low 32 bits: 0xFFFFFFFF - index.
    """
    bits = (vals + 0.0).contiguous().view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    return (ordered << 32) | (0xFFFFFFFF - idx)


def _key_index(keys: torch.Tensor) -> torch.Tensor:
    return 0xFFFFFFFF - (keys & 0xFFFFFFFF)


def sorted_topk(x: torch.Tensor, k: int, exact_ties: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of each row of float32 [n, V] in canonical order (value desc, then
    index asc, as a stable descending sort gives): returns (values float32 [n, k],
    indices int64 [n, k]).

    exact_ties: tokens tied with the k-th value are taken lowest index first, so the result
    is exactly ``x.sort(descending=True, stable=True)[:, :k]``. With False, which of the
    tokens tied with the k-th value are included is unspecified (cheaper); everything
    strictly above the k-th value is there, in canonical order.

    With k well below V on the CPU, the candidates come from the k 64-wide chunks with the
    largest maxima (together they hold a top k): several times cheaper than ``topk`` over
    the row. k >= V gives a full stable sort.
    """
    n, V = x.shape
    if k >= V:
        return x.sort(dim=-1, descending=True, stable=True)
    dev = x.device
    if chunkable(x) and k * CHUNK * 4 <= V:
        nc = V // CHUNK
        xv = x.view(n, nc, CHUNK)
        chunk_max = xv.amax(-1)
        if exact_ties:  # rank chunks by (max desc, chunk index asc): they hold the canonical top k
            chunk_keys = _order_keys(chunk_max, torch.arange(nc, device=dev).expand(n, nc))
            ci = _key_index(chunk_keys.topk(k, dim=-1, sorted=False).values)
        else:
            ci = chunk_max.topk(k, dim=-1, sorted=False).indices
        rows = torch.arange(n, device=dev).unsqueeze(1)
        sub = xv[rows, ci].reshape(n, k * CHUNK)
        sub_idx = (ci.unsqueeze(-1) * CHUNK + torch.arange(CHUNK, device=dev)).reshape(n, k * CHUNK)
        if exact_ties:
            idx = _key_index(_order_keys(sub, sub_idx).topk(k, dim=-1, sorted=True).values)
            return x.gather(1, idx), idx
        vals, j = sub.topk(k, dim=-1, sorted=True)
        idx = sub_idx.gather(1, j)
    elif exact_ties:
        keys = _order_keys(x, torch.arange(V, device=dev).expand(n, V))
        idx = _key_index(keys.topk(k, dim=-1, sorted=True).values)
        return x.gather(1, idx), idx
    else:
        vals, idx = x.topk(k, dim=-1, sorted=True)
    if k > 1 and bool((vals[:, 1:] == vals[:, :-1]).any()):
        # topk orders ties arbitrarily: sort by (value desc, index asc).
        idx = _key_index(_order_keys(vals, idx).sort(dim=-1, descending=True).values)
        vals = x.gather(1, idx)
    return vals, idx


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


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """float32 [n]: log(sum(exp(x))) per row of float32 [n, V] (rows with a finite max).

    Computed as ``max + log(sum(2 ** ((x - max) * log2(e))))``: ``exp2`` is several times
    faster than ``exp`` in PyTorch's CPU kernels, and nothing [n, V] is kept.
    """
    m = x.amax(-1, keepdim=True)
    s = (x - m).mul_(_LOG2E).exp2_().sum(-1)
    return m.squeeze(1) + torch.log(s)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of the given tokens, their ranks and the top-``num_logprobs`` tokens.

    logits: float32 [N, V], raw (logprob = logit - logsumexp of the row). token_ids: int64
    [N]. num_logprobs: K >= 0, or -1 for the whole vocabulary (K = V).
    Values match ``torch.log_softmax`` to ~1e-6; the top-K come in canonical order (logprob
    desc, token id asc); rank = 1 + #tokens with a strictly greater logit.

    Raises ValueError if ``num_logprobs < -1``.
    """
    if num_logprobs < -1:
        raise ValueError(f"num_logprobs must be >= -1, got {num_logprobs}")
    N, V = logits.shape
    k = V if num_logprobs == -1 else min(num_logprobs, V)
    token_ids = token_ids.to(device=logits.device, dtype=torch.long).unsqueeze(1)
    lse = row_logsumexp(logits).unsqueeze(1)  # [N, 1]
    token_logit = logits.gather(1, token_ids)  # [N, 1]
    if k == 0:
        ranks = (logits > token_logit).sum(-1) + 1
        return LogprobsTensors(token_ids, token_logit - lse, ranks)
    top_logit, top_ids = sorted_topk(logits, k)
    # Everything above the token lies in the top-k when the token is not below the k-th.
    ranks = (top_logit > token_logit).sum(-1) + 1
    outside = (token_logit.squeeze(1) < top_logit[:, -1]).nonzero().squeeze(1)
    if outside.numel():
        sub = take_rows(logits, outside)
        ranks[outside] = (sub > token_logit.index_select(0, outside)).sum(-1) + 1
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids, top_ids], dim=1),
        logprobs=torch.cat([token_logit, top_logit], dim=1) - lse,
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
        return logprobs_of(raw_logits, sampled, num_logprobs)
    sub = logprobs_of(take_rows(raw_logits, rows), sampled.index_select(0, rows), num_logprobs)
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
    logits = logits.float()
    if not logits.is_contiguous():
        logits = logits.contiguous()
    return logprobs_of(logits, target_token_ids, num_logprobs)
