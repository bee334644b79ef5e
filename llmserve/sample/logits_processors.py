"""Per-request logits processors for rarely used features (vLLM v1 ``LogitsProcessor``s).

Each function edits ``logits`` (float32 [B, V], the sampler's working copy) in place and
only touches the rows listed in ``SamplingMetadata`` for that feature, so a step whose
requests use none of them costs nothing. Order (vLLM v1 ``Sampler.forward``):
allowed_token_ids -> bad_words -> min_tokens -> logit_bias, then penalties.

Token ids outside ``[0, V)`` are ignored here; the InputProcessor rejects them up front
(see ``metadata.validate_token_ids``).
"""
from __future__ import annotations

import torch

from llmserve.sample.metadata import SamplingMetadata, SamplingRequestState

_NEG_INF = float("-inf")


def _ids_tensor(ids, vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = [int(t) for t in ids if 0 <= int(t) < vocab_size]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _allowed_mask(st: SamplingRequestState, vocab_size: int, device: torch.device) -> torch.Tensor:
    c = st.cache
    if c.allowed_mask is None or c.allowed_mask.numel() != vocab_size:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[_ids_tensor(st.sampling_params.allowed_token_ids, vocab_size, device)] = True
        c.allowed_mask = mask
    return c.allowed_mask


def apply_allowed_token_ids(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Set every token not in ``allowed_token_ids`` to -inf (vLLM ``allowed_token_ids``)."""
    V = logits.shape[1]
    for i in meta.allowed_rows:
        mask = _allowed_mask(meta.reqs[i], V, logits.device)
        logits[i].masked_fill_(~mask, _NEG_INF)


def banned_bad_word_tokens(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Token ids that would complete a bad word given the output so far.

    A bad word tokenized as ``[t1, ..., tn]`` bans ``tn`` when the output ends with
    ``[t1, ..., t(n-1)]`` (a one-token bad word is always banned). Only generated tokens
    count, not the prompt (vLLM v1 ``apply_bad_words``).
    """
    banned: list[int] = []
    n_out = len(output_token_ids)
    for word in bad_words_token_ids:
        if not word:
            continue
        prefix_len = len(word) - 1
        if prefix_len > n_out:
            continue
        if prefix_len == 0 or output_token_ids[n_out - prefix_len:] == list(word[:-1]):
            banned.append(int(word[-1]))
    return banned


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Ban the last token of each bad word whose other tokens end the output (-inf)."""
    V = logits.shape[1]
    for i in meta.bad_words_rows:
        st = meta.reqs[i]
        banned = banned_bad_word_tokens(st.sampling_params.bad_words_token_ids, st.output_token_ids)
        if banned:
            logits[i, _ids_tensor(banned, V, logits.device)] = _NEG_INF


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Block EOS and ``all_stop_token_ids`` (-inf) while fewer than ``min_tokens`` tokens
    have been generated (vLLM ``MinTokensLogitsProcessor``). EOS is blocked even with
    ``ignore_eos``. ``meta.min_tokens_rows`` already holds only rows still under the bound.
    """
    V = logits.shape[1]
    for i in meta.min_tokens_rows:
        st = meta.reqs[i]
        ids = set(st.sampling_params.all_stop_token_ids)
        if st.eos_token_id is not None:
            ids.add(st.eos_token_id)
        if ids:
            logits[i, _ids_tensor(sorted(ids), V, logits.device)] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Add ``logit_bias[token]`` to the token's logit (OpenAI ``logit_bias``; the values
    were clamped to [-100, 100] by SamplingParams)."""
    V = logits.shape[1]
    for i in meta.logit_bias_rows:
        st = meta.reqs[i]
        c = st.cache
        if c.bias_ids is None:
            items = [(int(t), float(b)) for t, b in st.sampling_params.logit_bias.items()
                     if 0 <= int(t) < V]
            c.bias_ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=logits.device)
            c.bias_values = torch.tensor([b for _, b in items], dtype=torch.float32,
                                         device=logits.device)
        if c.bias_ids.numel():
            logits[i].index_add_(0, c.bias_ids, c.bias_values)
