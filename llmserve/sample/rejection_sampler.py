"""Verification of n-gram drafts (speculative decoding) by rejection sampling.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) accepts a draft token
``d`` drawn from the draft distribution ``q`` with probability ``min(1, p(d) / q(d))`` and,
on rejection, samples from ``normalize(max(p - q, 0))``; the output then follows the
target ``p`` exactly. An n-gram draft is deterministic: ``q`` is a point mass on ``d``, so
the rule becomes "accept with probability p(d); on rejection sample from p with d
removed". Drawing ``x ~ p`` with the sampler as usual and accepting when ``x == d`` (else
emitting ``x``) is exactly that rule: P(accept) = p(d), and given rejection ``x`` is
distributed as p restricted to tokens != d. Greedy rows are the case where ``p`` is a
point mass on the argmax (accept the longest prefix where argmax equals the draft, then
the argmax as the correction). vLLM's ``RejectionSampler`` handles point-mass drafts
(``ngram``) the same way in effect.

So every position j of a request with drafts ``d[0..k)`` is sampled by the ordinary
:class:`~llmserve.sample.sampler.Sampler` pipeline as if ``d[:j]`` had already been
emitted: min_tokens, bad_words, the seeded stream's output position (a seeded request's
uniform for output position ``p`` is a pure function of (seed, p): metadata.SeededStream)
all see the right history. Tokens are taken up to and including the first one that
differs from its draft (or the bonus token after k accepted drafts). Hence a seeded or
greedy request emits the same tokens with and without speculation (given the same
logits: the runner pads GEMMs for seeded requests, ``--batch-invariant`` for greedy ones),
and its logprobs are those of each emitted position, as without speculation.

Penalties are not supported here (their seen-token cache is incremental per request): the
scheduler does not draft for such requests (spec_decode/scheduling.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from llmserve.sample.metadata import SamplingMetadata, SamplingRequestState

# (request state, its draft tokens, logits row of its real token; the draft positions
# follow in the next rows)
DraftEntry = tuple[SamplingRequestState, list[int], int]


def _with_drafts(st: SamplingRequestState, drafts: list[int]) -> SamplingRequestState:
    """``st`` as seen after ``drafts`` were emitted (same params, seed stream and caches)."""
    return replace(st, output_token_ids=st.output_token_ids + drafts) if drafts else st


def accepted_prefix(sampled: list[int], drafts: list[int]) -> list[int]:
    """Tokens emitted from one request's sampled positions ``sampled`` (len(drafts) + 1):
    every sampled token up to and including the first that differs from its draft."""
    out = []
    for j, tok in enumerate(sampled):
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out


def sample_and_verify(sampler, logits: torch.Tensor, entries: list[DraftEntry], vocab_size: int
                      ) -> tuple[list[list[int]], Optional[list[tuple[list, list, list]]]]:
    """Sample every position of ``entries`` and verify the drafts.

    logits: float [N, V'] (V' >= vocab_size) of the step's logit rows. entries: one per
    request that samples (drafts may be empty: one row). Returns (per entry, the emitted
    token ids: accepted drafts then one bonus/correction token, at least one; and, when
    some request asks for logprobs, per entry ``(token_ids, logprobs, ranks)`` lists with
    one item per emitted position, of all K+1 columns, else None).
    """
    rows: list[int] = []
    states: list[SamplingRequestState] = []
    for st, drafts, row in entries:
        for j in range(len(drafts) + 1):
            rows.append(row + j)
            states.append(_with_drafts(st, drafts[:j]))
    x = logits[torch.tensor(rows, device=logits.device)]
    meta = SamplingMetadata.build(states, vocab_size, logits.device)
    so = sampler(x.float(), meta)
    tokens = so.sampled_token_ids.tolist()
    emitted: list[list[int]] = []
    starts = []
    i = 0
    for _, drafts, _ in entries:
        starts.append(i)
        emitted.append(accepted_prefix(tokens[i:i + len(drafts) + 1], drafts))
        i += len(drafts) + 1
    lpt = so.logprobs_tensors
    if lpt is None:
        return emitted, None
    ids_l, lps_l, ranks_l = (lpt.logprob_token_ids.tolist(), lpt.logprobs.tolist(),
                             lpt.selected_token_ranks.tolist())
    lps = [(ids_l[s:s + len(e)], lps_l[s:s + len(e)], ranks_l[s:s + len(e)]) for s, e in zip(starts, emitted)]
    return emitted, lps
