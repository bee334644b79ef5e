"""The Sampler: logits of one step -> one token per row (vLLM v1 ``Sampler``).

Pipeline (vLLM v1 ``Sampler.forward``), on a float32 copy of the logits, only where some
row needs it:

  1. allowed_token_ids, bad_words, min_tokens, logit_bias   (logits_processors.py)
  2. repetition / frequency / presence penalties            (penalties.py)
  3. greedy rows (temperature 0, or top_k 1): argmax, first maximum on ties (as HF).
     Random rows: logits / temperature, then top-k, top-p (on the top-k-renormalised
     distribution), then min-p (keep p >= min_p * p_max), then draw one token.

Logprobs are computed from the *raw* logits (logprobs.py), so they do not depend on the
sampling settings.

Drawing: each random row draws ONE uniform number u in [0, 1) per step, from its own
``torch.Generator`` when the request is seeded (the default RNG otherwise, in one batched
draw), and takes the token where the cumulative distribution first exceeds u (inverse
CDF). The token is a function of the row's own logits and its own generator only, so a
seeded request gives the same tokens alone or in any batch. (vLLM's exponential race,
``argmax(p / q)`` with ``q ~ Exp(1)`` of size V per row, samples the same distribution but
draws V numbers per row per step: ~1 ms per row on these CPUs, too slow.)

Top-k / top-p without a full sort: the top ``C`` logits (C = 64 at first, or the largest
top_k) are taken with ``topk``, ordered by (value desc, index asc) so ties resolve like
argmax, and the nucleus is cut inside them; the mass of the whole row comes from one
``logsumexp``. A row whose nucleus does not end within C candidates is redone with 16x more,
then with a full stable sort.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from llmserve.sample.logits_processors import (apply_allowed_token_ids, apply_bad_words,
                                               apply_logit_bias, apply_min_tokens)
from llmserve.sample.logprobs import LogprobsTensors, compute_sampled_logprobs
from llmserve.sample.metadata import RandomGroup, SamplingMetadata
from llmserve.sample.penalties import apply_penalties

logger = logging.getLogger(__name__)

_ARGMAX_CHUNK = 128


@dataclass
class SamplerOutput:
    """sampled_token_ids: int64 [B], one token per row. logprobs_tensors: raw logprobs
    of the sampled tokens plus the top-K (K = max ``logprobs`` in the batch), or None when
    no row asked for logprobs."""

    sampled_token_ids: torch.Tensor
    logprobs_tensors: Optional[LogprobsTensors]


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row: int64 [B] from float32 [B, V].

    Same result as ``torch.argmax(logits, -1)`` (first max on ties, as HF greedy
    decoding). On the CPU it is computed in two stages (max of 128-wide chunks, then the
    argmax inside the first chunk holding the row maximum), about 2x faster than
    ``torch.argmax`` for [64, 49152].
    """
    B, V = logits.shape
    if logits.device.type != "cpu" or V % _ARGMAX_CHUNK or V < 64 * _ARGMAX_CHUNK or not logits.is_contiguous():
        return logits.argmax(-1)
    chunks = logits.view(B, V // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best_chunk = chunks.amax(-1).argmax(-1)  # [B] first chunk whose max is the row max
    inside = chunks[torch.arange(B, device=logits.device), best_chunk].argmax(-1)
    return best_chunk * _ARGMAX_CHUNK + inside


def _draw_uniforms(group: RandomGroup, device: torch.device) -> torch.Tensor:
    """float32 [n] in [0, 1): one draw per row; seeded rows draw from their own generator."""
    u = torch.rand(group.size, device=device)
    for j, gen in group.generators:
        u[j] = torch.rand(1, generator=gen, device=gen.device).to(device)[0]
    return u


def _sample_full(x: torch.Tensor, g: RandomGroup, u: torch.Tensor) -> torch.Tensor:
    """Sample from softmax(x / T) (after min-p) by inverse CDF. x: float32 [n, V]."""
    V = x.shape[1]
    z = x * g.inv_temperature
    if g.min_p is not None:
        # min-p (Nguyen et al. 2024; vLLM): keep p >= min_p * p_max, i.e.
        # z >= z_max + log(min_p); log(0) = -inf keeps everything.
        thr = z.amax(-1, keepdim=True) + torch.log(g.min_p).unsqueeze(1)
        z.masked_fill_(z < thr, float("-inf"))
    cdf = torch.softmax(z, dim=-1).cumsum_(-1)
    target = u.unsqueeze(1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    over = idx >= V
    if bool(over.any()):  # u * total rounded up to total: take the last token with p > 0
        last = V - 1 - torch.isfinite(z.flip(-1)).to(torch.int8).argmax(-1)
        idx = torch.where(over, last, idx)
    return idx


def _top_candidates(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``c`` of each row ordered by (value desc, index asc): float32 and int64 [n, c]."""
    if c >= x.shape[1]:
        return x.sort(-1, descending=True, stable=True)
    vals, idx = x.topk(c, dim=-1)
    idx, order = idx.sort(-1)
    vals = vals.gather(1, order)
    vals, order = vals.sort(-1, descending=True, stable=True)
    return vals, idx.gather(1, order)


def _sample_truncated(x: torch.Tensor, g: RandomGroup, u: torch.Tensor) -> torch.Tensor:
    """Sample with top-k, then top-p, then min-p. x: float32 [n, V] -> int64 [n].

    Every cut keeps a prefix of the tokens sorted by logit, so all that is needed is the
    prefix length and the cumulative weights ``cumsum(exp(z - z_max))`` of the candidates.
    """
    n, V = x.shape
    dev = x.device
    top_k = g.top_k if g.top_k is not None else torch.full((n,), V, dtype=torch.long, device=dev)
    out = torch.empty(n, dtype=torch.long, device=dev)
    pending: Optional[torch.Tensor] = None  # rows still to do; None = all rows
    c = g.initial_candidates
    while True:
        if c * 4 >= V:
            c = V

        def sel(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return t if t is None or pending is None else t.index_select(0, pending)

        xs, inv_t, k, top_p, min_p, uu = (sel(x), sel(g.inv_temperature), sel(top_k),
                                          sel(g.top_p), sel(g.min_p), sel(u))
        vals, idx = _top_candidates(xs, c)
        z = vals * inv_t
        w = torch.exp(z - z[:, :1])  # weights relative to the max, in (0, 1]
        cw = w.cumsum(-1)
        k_in = k.clamp(max=c)
        limited = k <= c  # the whole top-k set is among the candidates
        keep = k_in
        if top_p is not None:
            total = cw.gather(1, (k_in - 1).unsqueeze(1)).squeeze(1)
            if not bool(limited.all()):
                # Mass of the whole row, relative to its max: exp(logsumexp(z) - z_max).
                row_total = torch.exp(torch.logsumexp(xs * inv_t, dim=-1) - z[:, 0])
                total = torch.where(limited, total, row_total)
            # Nucleus: tokens whose preceding mass is < top_p (the first always stays).
            in_p = (cw - w) < (top_p * total).unsqueeze(1)
            in_p |= (top_p >= 1.0).unsqueeze(1)
            keep = torch.minimum(keep, in_p.sum(-1))
        if min_p is not None:
            in_min_p = z >= z[:, :1] + torch.log(min_p).unsqueeze(1)
            keep = torch.minimum(keep, in_min_p.sum(-1))
        keep = torch.minimum(keep, (w > 0).sum(-1)).clamp(min=1)
        covered = limited | (keep < c)
        target = uu * cw.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
        j = torch.searchsorted(cw, target.unsqueeze(1), right=True).squeeze(1)
        j = torch.minimum(j, keep - 1)
        tokens = idx.gather(1, j.unsqueeze(1)).squeeze(1)
        all_covered = bool(covered.all())
        if pending is None and all_covered:
            return tokens
        rows = torch.arange(n, device=dev) if pending is None else pending
        out[rows[covered]] = tokens[covered]
        if all_covered:
            return out
        pending = rows[~covered]
        c *= 16


class Sampler(nn.Module):
    """Turns a step's logits into tokens (and raw logprobs) per ``SamplingMetadata``.

    ``forward(logits, meta)``: logits float32 [B, V'] with V' >= ``meta.vocab_size``
    (extra padded columns are dropped), row i belonging to ``meta.reqs[i]``. Returns a
    :class:`SamplerOutput`. The input tensor is never modified.

    Raises ValueError if the logits' shape does not match the metadata.
    """

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits must be [{meta.num_rows}, V], got {tuple(logits.shape)}")
        if logits.shape[1] < meta.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the vocab "
                             f"size {meta.vocab_size}")
        if logits.shape[1] > meta.vocab_size:
            logits = logits[:, :meta.vocab_size]
        if logits.dtype != torch.float32:
            logits = logits.float()
        x = self.process_logits(logits, meta)
        sampled = self.sample(x, meta)
        lp = None
        if meta.max_num_logprobs is not None:
            lp = compute_sampled_logprobs(logits, sampled, meta.max_num_logprobs, meta.logprobs_rows)
        return SamplerOutput(sampled, lp)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Steps 1-2 of the pipeline on a copy; returns ``logits`` itself when no row
        needs any of them. A row left with every token at -inf (e.g. allowed_token_ids
        that are all stop tokens under min_tokens) falls back to its raw logits."""
        if not meta.needs_processing:
            return logits
        x = logits.clone()
        apply_allowed_token_ids(x, meta)
        apply_bad_words(x, meta)
        apply_min_tokens(x, meta)
        masked = sorted(set(meta.allowed_rows) | set(meta.bad_words_rows) | set(meta.min_tokens_rows))
        if masked:
            rows_t = torch.tensor(masked, dtype=torch.long, device=x.device)
            dead = torch.isneginf(x.index_select(0, rows_t).amax(-1))
            for r in rows_t[dead].tolist():
                logger.warning("every token of request row %d is blocked by its sampling "
                               "constraints; sampling from the unconstrained logits", r)
                x[r] = logits[r]
        apply_logit_bias(x, meta)
        apply_penalties(x, meta)
        return x

    @staticmethod
    def sample(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Step 3: int64 [B] tokens from processed float32 logits [B, V]."""
        if meta.all_greedy:
            return greedy_argmax(x)
        out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        if meta.greedy_rows is not None:
            out[meta.greedy_rows] = greedy_argmax(x.index_select(0, meta.greedy_rows))
        for group, fn in ((meta.full_group, _sample_full), (meta.truncated_group, _sample_truncated)):
            if group is None:
                continue
            xs = x if group.rows is None else x.index_select(0, group.rows)
            tokens = fn(xs, group, _draw_uniforms(group, x.device))
            if group.rows is None:
                return tokens
            out[group.rows] = tokens
        return out
