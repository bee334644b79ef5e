"""Repetition, frequency and presence penalties, vectorised over the penalised rows.

Sources:
  * repetition_penalty: CTRL (Keskar et al. 2019, arXiv:1909.05858), as in HF
    ``RepetitionPenaltyLogitsProcessor`` and vLLM ``apply_penalties``: for every token seen
    in the prompt OR the output, ``logit / penalty`` if ``logit > 0`` else
    ``logit * penalty``.
  * frequency_penalty / presence_penalty: OpenAI's definitions, on generated tokens only:
    ``logit -= frequency_penalty * count(token in output)
               + presence_penalty * (count > 0)``.

Per-request token counts are kept in ``SamplingRequestState.cache`` and updated with the
tokens appended since the last step, so a step costs O(new tokens) Python work plus a
few passes over a [P, V] tensor, whatever the output length.
"""
from __future__ import annotations

import torch

from llmserve.sample.metadata import SamplingMetadata, SamplingRequestState


def output_token_counts(st: SamplingRequestState, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token in ``st.output_token_ids``: float32 [vocab_size].

    Incremental: only the tokens appended since the previous call are added. If the output
    list got shorter (e.g. the runner rolled tokens back), the counts are rebuilt.
    Out-of-vocab ids are ignored.
    """
    c = st.cache
    out = st.output_token_ids
    n = len(out)
    if c.output_counts is None or c.output_counts.numel() != vocab_size or n < c.num_counted:
        c.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        c.num_counted = 0
    if n > c.num_counted:
        new = [int(t) for t in out[c.num_counted:n] if 0 <= int(t) < vocab_size]
        if len(new) == 1:
            c.output_counts[new[0]] += 1.0
        elif new:
            ids = torch.tensor(new, dtype=torch.long, device=device)
            c.output_counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.float32, device=device))
        c.num_counted = n
    return c.output_counts


def prompt_token_mask(st: SamplingRequestState, vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [vocab_size], True for tokens that occur in the prompt (built once)."""
    c = st.cache
    if c.prompt_mask is None or c.prompt_mask.numel() != vocab_size:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        ids = [int(t) for t in st.prompt_token_ids if 0 <= int(t) < vocab_size]
        if ids:
            mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
        c.prompt_mask = mask
    return c.prompt_mask


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Apply the three penalties in place to ``logits`` (float32 [B, V]) for the rows in
    ``meta.penalty_rows``; other rows are untouched.

    -inf logits stay -inf (a masked token stays masked).
    """
    rows = meta.penalty_rows
    if not rows:
        return
    V = logits.shape[1]
    dev = logits.device
    reqs = [meta.reqs[i] for i in rows]
    use_rep = any(st.sampling_params.repetition_penalty != 1.0 for st in reqs)
    use_freq = any(st.sampling_params.frequency_penalty != 0.0 for st in reqs)
    use_pres = any(st.sampling_params.presence_penalty != 0.0 for st in reqs)
    whole = len(rows) == logits.shape[0]
    rows_t = None if whole else torch.tensor(rows, dtype=torch.long, device=dev)
    x = logits if whole else logits.index_select(0, rows_t)

    counts = torch.stack([output_token_counts(st, V, dev) for st in reqs])  # [P, V] float32
    present = counts > 0
    if use_rep:
        seen = torch.stack([prompt_token_mask(st, V, dev) for st in reqs]) | present
        r = meta.repetition_penalties.unsqueeze(1)
        scaled = torch.where(x > 0, x / r, x * r)
        x = torch.where(seen, scaled, x)
    if use_freq:
        x = x - meta.frequency_penalties.unsqueeze(1) * counts
    if use_pres:
        x = x - meta.presence_penalties.unsqueeze(1) * present.to(torch.float32)

    if whole:
        if x is not logits:
            logits.copy_(x)
    else:
        logits.index_copy_(0, rows_t, x)
