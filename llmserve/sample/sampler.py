"""The Sampler: logits of one step -> one token per row (vLLM v1 ``Sampler``).

Pipeline (vLLM v1 ``Sampler.forward``), on a float32 copy of the logits, only where some
row needs it:

  1. allowed_token_ids, bad_words, min_tokens, logit_bias   (logits_processors.py)
  2. repetition / frequency / presence penalties            (penalties.py)
  3. greedy rows (temperature 0, or top_k 1): argmax, first maximum on ties (as HF).
     Random rows: logits / temperature, then top-k, top-p (on the top-k-renormalised
     distribution), then min-p (keep p >= min_p * p_max), then draw one token.

Logprobs are computed from the *raw* logits (logprobs.py), so they do not depend on the
sampling settings; the one exception is a beam-search row, whose top-K row is that of
``logits / temperature`` (``SamplingMetadata.logprobs_scale``; core/beam_search.py).

Drawing: each random row draws ONE uniform number u in [0, 1) per step: a seeded
request's is a function of (seed, output position) (``metadata.SeededStream``), others
come from the default RNG in one batched draw; the row takes the token where the
cumulative distribution first exceeds ``u * total`` (inverse CDF). The token is a
function of the row's own logits and its own draw only, so a seeded request gives the
same tokens alone, in any batch, and after preemption and recompute.
(vLLM's exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)``, samples the same
distribution but draws V numbers per row per step: ~1 ms per row on these CPUs.)

Cost on the CPU is kept to a few passes over [B, V]:
  * argmax / the inverse CDF work on 64-wide chunks (chunk maxima or chunk sums first,
    then one chunk), so there is no full-width cumsum or slow ``argmax`` pass;
  * top-k / top-p never sort the vocabulary: the top ``C`` logits (C = 64, or twice the
    largest top_k) are found from the chunk maxima, ordered by (value desc, index asc) so that
    ties resolve like argmax, and the nucleus is cut inside them, with the row's total
    mass from one exp pass. A row whose nucleus is longer than C is redone with 4x
    more candidates (a full stable sort only past V/2).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from llmserve.ops import cpu_ops
from llmserve.sample.logits_processors import (apply_allowed_token_ids, apply_bad_words,
                                               apply_logit_bias, apply_min_tokens)
from llmserve.sample.logprobs import (CHUNK as _CHUNK, LogprobsTensors, chunkable,
                                      compute_sampled_logprobs, sorted_topk, take_rows)
from llmserve.sample.metadata import RandomGroup, SamplingMetadata
from llmserve.sample.penalties import apply_penalties

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634


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
    decoding). On the CPU it runs in two stages (maxima of 64-wide chunks, then the argmax
    inside the first chunk holding the row maximum), several times faster than
    ``torch.argmax`` at [64, 49152].
    """
    B, V = logits.shape
    if not chunkable(logits):
        return logits.argmax(-1)
    chunks = logits.view(B, V // _CHUNK, _CHUNK)
    best_chunk = chunks.amax(-1).argmax(-1)  # [B] first chunk whose max is the row max
    inside = chunks[torch.arange(B, device=logits.device), best_chunk].argmax(-1)
    return best_chunk * _CHUNK + inside


def _draw_uniforms(group: RandomGroup, device: torch.device) -> torch.Tensor:
    """float32 [n] in [0, 1): one draw per row; seeded rows take their stream's value."""
    u = torch.rand(group.size, device=device)
    if group.generators:
        j, vals = zip(*group.generators)
        u[list(j)] = torch.tensor(vals, dtype=torch.float32, device=device)
    return u


def _last_positive(cdf: torch.Tensor) -> torch.Tensor:
    """int64 [n]: for nondecreasing rows, the first index reaching the row's final value
    (the last position with a positive increment)."""
    return torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False).squeeze(1)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn with probability w / w.sum() per row: int64 [n] from weights [n, V] >= 0
    (at least one positive per row) and u [n] in [0, 1)."""
    n, V = w.shape
    if not chunkable(w):
        cdf = w.cumsum(-1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        return torch.minimum(idx, _last_positive(cdf))
    # Two levels: pick a chunk by the cumulative chunk sums, then a token inside it.
    wv = w.view(n, V // _CHUNK, _CHUNK)
    ccdf = wv.sum(-1).cumsum(-1)  # [n, V/64]
    target = u * ccdf[:, -1]
    ci = torch.searchsorted(ccdf, target.unsqueeze(1), right=True).squeeze(1)
    ci = torch.minimum(ci, _last_positive(ccdf))
    before = torch.where(ci > 0, ccdf.gather(1, (ci - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(target))
    inner = wv[torch.arange(n, device=w.device), ci].cumsum(-1)  # [n, 64]
    j = torch.searchsorted(inner, (target - before).unsqueeze(1), right=True).squeeze(1)
    return ci * _CHUNK + torch.minimum(j, _last_positive(inner))


def _relative_weights(x: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """exp((x - max) / T) per row: float32 [n, V] in [0, 1], 1 at the row maximum.

    Computed as 2 ** ((x - max) * log2(e) / T): ``exp2`` is ~3x faster than ``exp`` in
    PyTorch's CPU kernels.
    """
    return (x - x.amax(-1, keepdim=True)).mul_(inv_t * _LOG2E).exp2_()


def _sample_full(x: torch.Tensor, g: RandomGroup, u: torch.Tensor) -> torch.Tensor:
    """Sample from softmax(x / T), after min-p. x: float32 [n, V] -> int64 [n].

    Without min-p, on the CPU, one fused C++ pass per row does the same draw
    (``cpu_ops.sample_inverse_cdf``: no [n, V] temporaries, ~3x faster at 256 x 49152)."""
    if g.min_p is None and chunkable(x):
        ops = cpu_ops.get_cpu_ops()
        if ops is not None:
            out = torch.empty(x.shape[0], dtype=torch.long)
            k = (g.inv_temperature.reshape(-1).to(torch.float32) * _LOG2E).contiguous()
            ops.sample_inverse_cdf(out, x, k, u.to(torch.float32).contiguous())
            return out
    w = _relative_weights(x, g.inv_temperature)  # p / p_max
    if g.min_p is not None:
        # min-p (vLLM; Nguyen et al. 2024): keep p >= min_p * p_max, i.e. w >= min_p.
        if g.min_p_value is not None:  # one value: threshold_ keeps w > t, so t = prev float
            below = float(torch.nextafter(torch.tensor(g.min_p_value), torch.tensor(-1.0)))
            torch.nn.functional.threshold_(w, below, 0.0)
        else:
            w.masked_fill_(w < g.min_p.unsqueeze(1), 0.0)
    return _inverse_cdf(w, u)


def _cut_and_draw(vals: torch.Tensor, idx: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor,
                  top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor],
                  row_mass: Optional[torch.Tensor], u: torch.Tensor,
                  whole_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, top-p, min-p to ``c`` sorted candidates and draw.

    vals/idx: [m, c] from sorted_topk (whole_row: c == V, a full sort). row_mass: [m]
    sum(exp((x - max) / T)) over the whole row (needed by top-p rows whose top_k exceeds
    c). Every cut keeps a prefix of the candidates, so only the prefix length matters. Returns (tokens [m], covered [m]):
    rows not covered need more candidates. The candidates need not be the canonical top c
    among tokens tied with the c-th value (sorted_topk with exact_ties=False): a row only
    counts as covered when its kept prefix lies strictly above the c-th value, so which
    tied tokens were picked cannot matter, and its tokens are in canonical order.
    """
    c = vals.shape[1]
    # p / p_max, nonincreasing; computed like _relative_weights so it agrees with row_mass.
    w = (vals - vals[:, :1]).mul_(inv_t * _LOG2E).exp2_()
    cw = w.cumsum(-1)
    k_in = top_k.clamp(max=c)
    limited = top_k <= c  # the whole top-k set is among the candidates
    keep = k_in
    if top_p is not None:
        total = cw.gather(1, (k_in - 1).unsqueeze(1)).squeeze(1)
        if row_mass is not None:
            total = torch.where(limited, total, row_mass)
        # Nucleus: tokens whose preceding mass is < top_p (the first always stays).
        before = torch.nn.functional.pad(cw[:, :-1], (1, 0))  # exclusive prefix sums
        in_p = before < (top_p * total).unsqueeze(1)
        in_p |= (top_p >= 1.0).unsqueeze(1)
        keep = torch.minimum(keep, in_p.sum(-1))
    if min_p is not None:
        keep = torch.minimum(keep, (w >= min_p.unsqueeze(1)).sum(-1))
    keep = torch.minimum(keep, (w > 0).sum(-1)).clamp(min=1)
    if whole_row:
        covered = torch.ones_like(keep, dtype=torch.bool)
    else:
        last_kept = vals.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
        covered = (keep < c) & (last_kept > vals[:, -1])
    target = u * cw.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
    j = torch.searchsorted(cw, target.unsqueeze(1), right=True).squeeze(1)
    j = torch.minimum(j, keep - 1)
    return idx.gather(1, j.unsqueeze(1)).squeeze(1), covered


def _sample_truncated(x: torch.Tensor, g: RandomGroup, u: torch.Tensor) -> torch.Tensor:
    """Sample with top-k, then top-p, then min-p. x: float32 [n, V] -> int64 [n].

    Candidates grow 4x per round (64 -> 256 -> ... -> the whole row, sorted, once past
    V/2) for the rows whose cut did not fall strictly inside the previous candidates.
    """
    n, V = x.shape
    dev = x.device
    top_k = g.top_k if g.top_k is not None else torch.full((n,), V, dtype=torch.long, device=dev)
    row_mass = None
    if g.top_p is not None and bool(((top_k > g.initial_candidates) & (g.top_p < 1.0)).any()):
        # Mass of each whole row relative to its max: sum(exp((x - max) / T)).
        row_mass = _relative_weights(x, g.inv_temperature).sum(-1)
    out: Optional[torch.Tensor] = None
    pending: Optional[torch.Tensor] = None  # rows still to do; None = all rows
    c = g.initial_candidates
    while True:
        if c * 2 >= V:
            c = V

        def sel(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None or pending is None:
                return t
            return take_rows(t, pending) if t.dim() == 2 and t.shape[1] > 1 else t.index_select(0, pending)

        vals, idx = sorted_topk(sel(x), c, exact_ties=False)
        tokens, covered = _cut_and_draw(vals, idx, sel(g.inv_temperature), sel(top_k), sel(g.top_p),
                                        sel(g.min_p), sel(row_mass), sel(u), whole_row=c == V)
        if out is None:
            out = tokens
        else:
            out[pending[covered]] = tokens[covered]
        rows = torch.arange(n, device=dev) if pending is None else pending
        if bool(covered.all()):
            return out
        pending = rows[~covered]
        c *= 4


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
            lp_logits = logits if meta.logprobs_scale is None else logits * meta.logprobs_scale
            lp = compute_sampled_logprobs(lp_logits, sampled, meta.max_num_logprobs, meta.logprobs_rows)
        return SamplerOutput(sampled, lp)

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Steps 1-2 of the pipeline on a copy; returns ``logits`` itself when no row
        needs any of them. A row left with every token at -inf (e.g. allowed_token_ids
        that are all stop tokens under min_tokens) falls back to its raw logits."""
        if not meta.needs_processing:
            return logits
        x = logits.clone(memory_format=torch.contiguous_format)
        apply_allowed_token_ids(x, meta)
        apply_bad_words(x, meta)
        apply_min_tokens(x, meta)
        masked = sorted(set(meta.allowed_rows) | set(meta.bad_words_rows) | set(meta.min_tokens_rows))
        if masked:
            rows_t = torch.tensor(masked, dtype=torch.long, device=x.device)
            dead = torch.isneginf(take_rows(x, rows_t).amax(-1))
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
            out[meta.greedy_rows] = greedy_argmax(take_rows(x, meta.greedy_rows))
        for group, fn in ((meta.full_group, _sample_full), (meta.truncated_group, _sample_truncated)):
            if group is None:
                continue
            xs = x if group.rows is None else take_rows(x, group.rows)
            tokens = fn(xs, group, _draw_uniforms(group, x.device))
            if group.rows is None:
                return tokens
            out[group.rows] = tokens
        return out
