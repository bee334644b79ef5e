"""Prompt preparation that only pooling requests need, used by the InputProcessor:
the text-pair segment boundary (BERT's ``token_type_ids``, compressed as vLLM does) and
the last-non-pad-token rule of a decoder's classification head (transformers'
``*ForSequenceClassification``). Plain Python on token id lists; no torch."""
from __future__ import annotations

from typing import Any, Optional

from llmserve.sampling_params import SamplingParamsError


def task_hint(task: str) -> str:
    """What to pass for a model that lacks the pooling ``task`` (for the 400's message)."""
    if task in ("classify", "token_classify", "score"):
        return ("Serve a *ForSequenceClassification checkpoint with `--runner pooling` (it is detected, or pass "
                "`--convert classify`) to use its classification head.")
    return "Try passing `--runner pooling` (or `--convert embed`) to use the model as a pooling model."


def compress_token_type_ids(prompt: Any, num_tokens: int) -> Optional[int]:
    """The index where segment 1 starts in the prompt's ``token_type_ids`` (vLLM's
    ``compressed_token_type_ids``), or None when the prompt has none or all are 0.

    ``prompt``: the prompt as given (a dict may carry ``token_type_ids``, one 0/1 per
    token, zeros then ones, as a tokenizer writes them for a text pair). Raises
    SamplingParamsError (param ``token_type_ids``) for a list of another length or shape."""
    types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
    if types is None:
        return None
    types = list(types)
    if len(types) != num_tokens:
        raise SamplingParamsError(f"token_type_ids has {len(types)} values for {num_tokens} prompt tokens.",
                                  "token_type_ids")
    start = next((i for i, t in enumerate(types) if t != 0), num_tokens)
    if any(t != 1 for t in types[start:]):
        raise SamplingParamsError("token_type_ids must be zeros then ones (a text pair's two segments).",
                                  "token_type_ids")
    return start if start < num_tokens else None


def truncate_start(start: Optional[int], num_tokens: int, kept: int) -> Optional[int]:
    """``start`` (see ``compress_token_type_ids``) after keeping the last ``kept`` of
    ``num_tokens`` tokens (``truncate_prompt_tokens``)."""
    if start is None:
        return None
    return max(0, start - (num_tokens - kept))


def classified_prefix(ids: list[int], pad_token_id: Optional[int]) -> list[int]:
    """The tokens a decoder's classification head needs: up to and including the last
    token that is not ``pad_token_id`` (transformers' ``*ForSequenceClassification``
    pools that token: ``(arange * (ids != pad)).argmax()``, index 0 when every token is
    a pad; the last token when the config has no pad id). Under causal attention the
    tokens after it cannot change its hidden state, so they are not run."""
    if pad_token_id is None:
        return ids
    last = max((i for i, t in enumerate(ids) if t != pad_token_id), default=0)
    return ids[:last + 1]
