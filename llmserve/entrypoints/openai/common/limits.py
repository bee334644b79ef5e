"""The server's documented request limits, in one place (README "Request limits").

Each limit is a 400 naming the field past it (a 413 for the body size). They bound the
work one request can ask of the server before anything is tokenized: the list lengths
are checked by pydantic while the body is parsed (and appear in ``/openapi.json`` as
``maxItems`` / ``maxLength`` / ``maxProperties``), the body size by
:class:`~llmserve.entrypoints.openai.http_edges.BodyLimitMiddleware`, the prompt length
by :class:`PromptCharLimit` (characters, whitespace included) before the tokenizer runs.

vLLM has no such limits (its server takes any list); OpenAI documents ``stop`` (4)
and ``n`` (128, taken here). llmserve's limits are far above what a
real client sends and far below what hurts the server.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from llmserve.sampling_params import ContextLengthExceededError
from llmserve.json_limits import MAX_JSON_DEPTH, check_json_depth, json_too_deep  # noqa: F401  (re-exports)

# The request body, in bytes (``--max-request-body-bytes``; 0 turns the limit off).
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# ``n``: completions per prompt (OpenAI's own limit; n=512 on a CPU would not finish in
# a client's timeout, case C31).
MAX_N = 128
# ``stop``: stop strings, and characters per stop string.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# ``logit_bias``: entries.
MAX_LOGIT_BIAS_ENTRIES = 1024
# ``stop_token_ids`` and ``bad_words``: items.
MAX_TOKEN_ID_LIST_ITEMS = 1024
# ``allowed_token_ids``: items (a subset of the vocabulary, which may be large).
MAX_ALLOWED_TOKEN_IDS = 262144
# A prompt given as token ids: ids per prompt (validating millions of ids would hold the
# event loop; no context is this long, and truncation keeps at most the context).
MAX_PROMPT_TOKEN_IDS = 262144
# ``prompt`` of /v1/completions (and ``input`` of the pooling routes): prompts per request.
MAX_PROMPTS_PER_REQUEST = 1024
# ``messages``: messages per request, and content parts per message.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
# JSON nesting (MAX_JSON_DEPTH, json_too_deep, check_json_depth): in llmserve/json_limits.py,
# which the engine's structured-output code shares; re-exported here.
# A prompt of up to this many characters is always tokenized (so an over-long prompt is
# told its exact token count); beyond it and beyond ``PromptCharLimit.limit`` it is
# refused without tokenizing.
MIN_PROMPT_CHARS_CHECKED = 256 * 1024

# Python's whitespace (``str.split()``): the characters a tokenizer that collapses
# whitespace may drop (see :func:`keeps_whitespace`).
_ASCII_WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
_WHITESPACE = _ASCII_WHITESPACE + "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200b))) + \
    "\u2028\u2029\u202f\u205f\u3000"
# Runs :func:`keeps_whitespace` encodes: each whitespace kind a normalizer might collapse.
_WHITESPACE_PROBES = (" ", "\n", "\t", "\r\n", " \n", "\xa0", "\u3000")
_PROBE_CHARS = 4096


# tokenizer -> (longest_token_chars, keeps_whitespace): servers and tests build several
# apps on one tokenizer, and the vocabulary pass takes ~1 s
_TOKEN_CHARS: "weakref.WeakKeyDictionary[Any, tuple[int, bool]]" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters, whitespace included, that one token of ``tokenizer``'s
    vocabulary (added tokens included) stands for: the longer of its decoded text and its
    vocabulary string (byte-level BPE and SentencePiece write at least one symbol per
    byte/char, and a lone SentencePiece piece may decode without its leading space).
    So a text of more than ``k * this`` characters encodes to more than ``k`` tokens,
    unless the tokenizer's normalizer deletes characters. SmolLM2: 81 (a newline and 80
    spaces). Takes ~1 s for a 50k vocabulary."""
    return _token_chars(tokenizer)[0]


def keeps_whitespace(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` encodes runs of whitespace without collapsing them (measured:
    a run of 4096 of each kind in ``_WHITESPACE_PROBES`` needs at least ``4096 /
    longest_token_chars`` tokens). False for a normalizer that squeezes spaces
    (SentencePiece's ``remove_extra_whitespaces``), where whitespace is then not counted."""
    return _token_chars(tokenizer)[1]


def _token_chars(tokenizer: Any) -> tuple[int, bool]:
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab()
    ids = sorted(set(vocab.values()))
    texts = _decode_each(tokenizer, ids)
    longest = max(1, max(map(len, texts)), max(map(len, vocab)))
    kept = all(len(tokenizer.encode(ch * (_PROBE_CHARS // len(ch)), add_special_tokens=False)) * longest
               >= _PROBE_CHARS // len(ch) * len(ch) for ch in _WHITESPACE_PROBES)
    try:
        _TOKEN_CHARS[tokenizer] = (longest, kept)
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest, kept


def _decode_each(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id decoded alone. A fast tokenizer's Rust backend decodes the batch in one
    call: 0.04 s for SmolLM2's 49k ids against 0.41 s through ``batch_decode``, which
    loops in Python (measured; this pass runs at every server start). transformers'
    decode of a fast tokenizer is the backend's plus an optional clean-up that only
    removes characters, so the backend's texts are never shorter."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - an unusual backend: transformers' path below
            pass
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def non_whitespace_chars(text: str) -> int:
    """Characters of ``text`` that are not whitespace (C-speed passes, no copies)."""
    ws = _ASCII_WHITESPACE if text.isascii() else _WHITESPACE
    return len(text) - sum(text.count(c) for c in ws)


@dataclass(frozen=True)
class PromptCharLimit:
    """How many characters a prompt may have before it certainly exceeds the context.

    max_model_len: the context in tokens. max_token_chars: :func:`longest_token_chars` of
    the tokenizer. count_whitespace: :func:`keeps_whitespace` of the tokenizer. A text of
    more than ``max_model_len * max_token_chars`` characters (whitespace included: the
    tokenizer sees it, and a run of spaces costs tokens like any text) has more than
    ``max_model_len`` tokens, so it is refused (400) without running the tokenizer; the
    bound is exact in the direction that matters (no text that fits is refused). Texts of
    up to ``MIN_PROMPT_CHARS_CHECKED`` characters are always tokenized. For a tokenizer
    that collapses whitespace only the non-whitespace characters count. (A tokenizer that
    deletes other characters, such as control characters, could in theory fit a longer
    text; such input is refused too.)
    """

    max_model_len: int
    max_token_chars: int
    count_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_token_chars < 1:
            raise ValueError(f"PromptCharLimit needs positive values, got {self}")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> "PromptCharLimit":
        return cls(max_model_len, longest_token_chars(tokenizer), keeps_whitespace(tokenizer))

    @property
    def limit(self) -> int:
        """The most characters a prompt that fits can have."""
        return max(self.max_model_len * self.max_token_chars, MIN_PROMPT_CHARS_CHECKED)

    def check(self, texts: Iterable[Optional[str]], param: str) -> None:
        """Raise ContextLengthExceededError (400 naming ``param``) when the texts together have
        more characters than :attr:`limit`. O(1) per text (``len``), O(length) only for a
        tokenizer that collapses whitespace."""
        texts = [t for t in texts if t]
        chars = sum(map(len, texts))
        if chars <= self.limit:
            return
        kind = "characters"
        if not self.count_whitespace:
            chars, kind = sum(map(non_whitespace_chars, texts)), "non-whitespace characters"
        if chars > self.limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, `{param}` "
                f"holds {chars} {kind}, and no token of this model stands for more than "
                f"{self.max_token_chars} characters, so that is more than {chars // self.max_token_chars} "
                f"tokens, which cannot fit. Please reduce the length of `{param}`.", param)


def message_texts(messages: Iterable[Any]) -> list[str]:
    """The text of every message's content (strings and text parts), for
    :meth:`PromptCharLimit.check`; other fields and part kinds are ignored here. Each is
    stripped of leading and trailing whitespace, which chat templates often ``trim``
    (the rendered text is then checked whole before it is tokenized)."""
    out: list[str] = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, str):
            out.append(content.strip())
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    out.extend(v.strip() for k in ("text", "refusal") if isinstance(v := part.get(k), str))
    return out
