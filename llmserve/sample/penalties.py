"""Repetition, frequency and presence penalties, vectorised over the penalised rows.

Sources:
  * repetition_penalty: CTRL (Keskar et al. 2019, arXiv:1909.05858), as in HF
    ``RepetitionPenaltyLogitsProcessor`` and vLLM ``apply_penalties``: for every token seen
    in the prompt OR the output, ``logit / penalty`` if ``logit > 0`` else
    ``logit * penalty``.
  * frequency_penalty / presence_penalty: OpenAI's definitions, on generated tokens only:
    ``logit -= frequency_penalty * count(token in output)
               + presence_penalty * (count > 0)``.

Only the tokens a request has seen are touched, so the work is sparse: each request keeps
(in ``SamplingRequestState.cache.penalty``) the distinct tokens of its prompt and output
with their output counts, updated with the tokens appended since the last step (O(new
tokens) per step). A step gathers those (row, token) logits from the batch in one index
op, changes them and scatters them back.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from llmserve.sample.metadata import SamplingMetadata, SamplingRequestState


class SeenTokens:
    """Distinct tokens of one request's prompt and output, with their output counts.

    ids: int64 [n], counts: float32 [n] (occurrences in the output; 0 for tokens only in
    the prompt), growable numpy buffers whose first ``size`` entries are valid.
    ``num_counted`` output tokens have been added so far.
    """

    def __init__(self, prompt_token_ids: list[int], vocab_size: int):
        prompt = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        prompt = prompt[(prompt >= 0) & (prompt < vocab_size)]
        cap = max(16, 2 * len(prompt))
        self.ids = np.zeros(cap, dtype=np.int64)
        self.counts = np.zeros(cap, dtype=np.float32)
        self.size = len(prompt)
        self.ids[:self.size] = prompt
        self.pos: dict[int, int] = {int(t): i for i, t in enumerate(prompt.tolist())}
        self.num_counted = 0
        self.vocab_size = vocab_size

    def add(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            return
        i = self.pos.get(token_id)
        if i is None:
            if self.size == len(self.ids):
                self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
            i = self.size
            self.size += 1
            self.pos[token_id] = i
            self.ids[i] = token_id
        self.counts[i] += 1.0


def seen_tokens(st: SamplingRequestState, vocab_size: int) -> SeenTokens:
    """The request's SeenTokens, brought up to date with ``st.output_token_ids``.

    Built on first use; rebuilt if the output list got shorter (tokens rolled back).
    """
    seen: Optional[SeenTokens] = st.cache.penalty
    out = st.output_token_ids
    if seen is None or seen.vocab_size != vocab_size or len(out) < seen.num_counted:
        seen = SeenTokens(st.prompt_token_ids, vocab_size)
        st.cache.penalty = seen
    n = len(out)
    for t in out[seen.num_counted:n]:
        seen.add(int(t))
    seen.num_counted = n
    return seen


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Apply the three penalties in place to ``logits`` (contiguous float32 [B, V]) for the
    rows in ``meta.penalty_rows``; other rows are untouched. -inf logits stay -inf."""
    rows = meta.penalty_rows
    if not rows:
        return
    V = logits.shape[1]
    dev = logits.device
    seens = [seen_tokens(meta.reqs[i], V) for i in rows]
    lengths = np.array([s.size for s in seens], dtype=np.int64)
    if lengths.sum() == 0:
        return
    ids = np.concatenate([s.ids[:s.size] for s in seens])
    counts = np.concatenate([s.counts[:s.size] for s in seens])
    which = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)  # position in penalty_rows
    flat = torch.from_numpy(np.asarray(rows, dtype=np.int64)[which] * V + ids).to(dev)
    which_t = torch.from_numpy(which).to(dev)
    counts_t = torch.from_numpy(counts).to(dev)

    flat_logits = logits.view(-1)
    vals = flat_logits[flat]
    r = meta.repetition_penalties[which_t]
    vals = torch.where(vals > 0, vals / r, vals * r)
    vals -= meta.frequency_penalties[which_t] * counts_t
    vals -= meta.presence_penalties[which_t] * (counts_t > 0).to(torch.float32)
    flat_logits[flat] = vals
