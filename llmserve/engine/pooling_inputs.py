"""Prompt preparation that only pooling requests need, used by the InputProcessor and
the renderer: the text-pair segment boundary (BERT's ``token_type_ids``, compressed as
vLLM does), the last-non-pad-token rule of a decoder's classification head
(transformers' ``*ForSequenceClassification``) and ``truncate_prompt_tokens`` on text and
text pairs as the tokenizer cuts them. Plain Python on token id lists; no torch."""
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


def resolve_truncation(truncate_prompt_tokens: Optional[int], max_model_len: int) -> Optional[int]:
    """The token count text is cut to before the engine sees it: -1 read as
    ``max_model_len``; None when not set or not a valid count (the engine then answers
    the 400 naming ``truncate_prompt_tokens``)."""
    if truncate_prompt_tokens == -1:
        return max_model_len
    return truncate_prompt_tokens if truncate_prompt_tokens is not None and truncate_prompt_tokens > 0 else None


def _find(full: list[int], part: list[int], start: int) -> int:
    """The first index >= ``start`` where ``part`` sits in ``full``; -1 when nowhere."""
    for i in range(start, len(full) - len(part) + 1):
        if full[i:i + len(part)] == part:
            return i
    return -1


def truncate_text_ids(tokenizer: Any, text: str, k: int, add_special_tokens: bool = True) -> list[int]:
    """``text``'s token ids cut to at most ``k`` (a pooling request's
    ``truncate_prompt_tokens``, resolved) as the tokenizer's ``truncation=True,
    max_length=k`` cuts: the first tokens of the text are kept and so are the special
    tokens around it (BERT's [CLS] ... [SEP]; its [CLS] is what a classifier pools).
    vLLM truncates pooling prompts on the right since vllm-project/vllm#12050 (left, the
    last tokens, only for generation). Where the tokenizer's output is not specials + the
    text's own ids + specials, or ``k`` leaves no room for text, the first ``k`` ids are
    kept."""
    full = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    if len(full) <= k:
        return full
    body = list(tokenizer.encode(text, add_special_tokens=False))
    p = _find(full, body, 0) if body and add_special_tokens else -1
    room = k - (len(full) - len(body))
    if p < 0 or room <= 0:
        return full[:k]
    return full[:p] + body[:room] + full[p + len(body):]


def _longest_first(a: list[int], b: list[int], excess: int) -> tuple[list[int], list[int]]:
    """transformers' ``truncation="longest_first"`` in closed form: tokens come off the end
    of the longer sequence until both are as long, then one from each in turn (the second
    first), until ``excess`` are gone (its token-by-token loop took ~0.2 s for a
    2-million-token excess)."""
    la, lb = len(a), len(b)
    gap = min(abs(la - lb), excess)
    la, lb = (la - gap, lb) if la > lb else (la, lb - gap)
    rest = excess - gap
    return a[:la - rest // 2], b[:lb - (rest + 1) // 2]


def truncate_pair_ids(tokenizer: Any, text: str, text_pair: str, k: int, full: list[int],
                      types: Optional[list[int]], add_special_tokens: bool = True
                      ) -> Optional[tuple[list[int], Optional[list[int]]]]:
    """A text pair's ids (and ``token_type_ids``) cut to at most ``k`` as the tokenizer
    cuts with ``truncation=True, max_length=k`` (longest text first, from its end, the
    special tokens kept: the query stays whole unless it is the longer text). ``full``/
    ``types``: the uncut pair as the tokenizer joined it. None when ``full`` is not
    specials + the first text's ids + specials + the second's + specials (with one token
    type per text), or ``k`` leaves no room: the caller then leaves the cut to the engine."""
    a = list(tokenizer.encode(text, add_special_tokens=False))
    b = list(tokenizer.encode(text_pair, add_special_tokens=False))
    p = _find(full, a, 0)
    q = _find(full, b, p + len(a)) if p >= 0 else -1
    if q < 0 or k <= len(full) - len(a) - len(b):
        return None
    if types is not None and (len(set(types[p:p + len(a)])) > 1 or len(set(types[q:q + len(b)])) > 1):
        return None
    a2, b2 = _longest_first(a, b, len(full) - k)
    ids = full[:p] + a2 + full[p + len(a):q] + b2 + full[q + len(b):]
    if types is None:
        return ids, None
    ta, tb = types[p:p + 1] * len(a2), types[q:q + 1] * len(b2)
    return ids, types[:p] + ta + types[p + len(a):q] + tb + types[q + len(b):]
