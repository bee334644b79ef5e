"""The server's documented request limits, in one place (README "Request limits").

Each limit is a 400 naming the field past it (a 413 for the body size). They bound the
work one request can ask of the server before anything is tokenized: the list lengths
are checked by pydantic while the body is parsed (and appear in ``/openapi.json`` as
``maxItems`` / ``maxLength`` / ``maxProperties``), the body size by
:class:`~llmserve.entrypoints.openai.http_edges.BodyLimitMiddleware`, the prompt length
by :class:`PromptCharLimit` before the tokenizer runs.

vLLM has no such limits (its server takes any list); OpenAI documents ``stop`` (4)
and ``n`` (128, taken here). llmserve's limits are far above what a
real client sends and far below what hurts the server.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from llmserve.sampling_params import SamplingParamsError

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
# A prompt of up to this many characters is always tokenized (so an over-long prompt is
# told its exact token count); beyond it and beyond ``PromptCharLimit.limit`` it is
# refused without tokenizing.
MIN_PROMPT_CHARS_CHECKED = 256 * 1024

# Python's whitespace (``str.split()``): the characters PromptCharLimit does not count.
_ASCII_WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
_WHITESPACE = _ASCII_WHITESPACE + "\x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200b))) + \
    "\u2028\u2029\u202f\u205f\u3000"


# tokenizer -> longest_token_chars (servers and tests build several apps on one tokenizer)
_LONGEST_TOKEN_CHARS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The most non-whitespace characters one token of ``tokenizer``'s vocabulary (added
    tokens included) decodes to: no text with more than ``k * this`` non-whitespace
    characters encodes to ``k`` tokens or fewer. Takes ~1 s for a 50k vocabulary."""
    try:
        return _LONGEST_TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = sorted(set(tokenizer.get_vocab().values()))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    # a token's vocabulary string is never shorter than its text (byte-level BPE and
    # SentencePiece write one symbol per byte/char at least); take the larger to be safe
    longest = max(1, max(len("".join(t.split())) for t in texts))
    try:
        _LONGEST_TOKEN_CHARS[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


def non_whitespace_chars(text: str) -> int:
    """Characters of ``text`` that are not whitespace (C-speed passes, no copies)."""
    ws = _ASCII_WHITESPACE if text.isascii() else _WHITESPACE
    return len(text) - sum(text.count(c) for c in ws)


@dataclass(frozen=True)
class PromptCharLimit:
    """How many characters a prompt may have before it certainly exceeds the context.

    max_model_len: the context in tokens. max_token_chars: :func:`longest_token_chars` of
    the tokenizer. A text with more than ``max_model_len * max_token_chars`` non-whitespace
    characters has more than ``max_model_len`` tokens, so it is refused (400) without
    running the tokenizer; texts of up to ``MIN_PROMPT_CHARS_CHECKED`` characters are
    always tokenized. (A tokenizer that deletes non-whitespace characters, such as
    control characters, could in theory fit such a text; such input is refused too.)
    """

    max_model_len: int
    max_token_chars: int

    def __post_init__(self) -> None:
        if self.max_model_len < 1 or self.max_token_chars < 1:
            raise ValueError(f"PromptCharLimit needs positive values, got {self}")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> "PromptCharLimit":
        return cls(max_model_len, longest_token_chars(tokenizer))

    @property
    def limit(self) -> int:
        """The most non-whitespace characters a prompt that fits can have."""
        return max(self.max_model_len * self.max_token_chars, MIN_PROMPT_CHARS_CHECKED)

    def check(self, texts: Iterable[Optional[str]], param: str) -> None:
        """Raise SamplingParamsError (400 naming ``param``) when the texts together have
        more non-whitespace characters than :attr:`limit`. Cheap: O(total length), and
        only texts longer than the limit are scanned."""
        texts = [t for t in texts if t]
        total = sum(len(t) for t in texts)
        if total <= self.limit:
            return
        chars = sum(non_whitespace_chars(t) for t in texts)
        if chars > self.limit:
            raise SamplingParamsError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, `{param}` "
                f"holds {chars} non-whitespace characters, and no token of this model is longer than "
                f"{self.max_token_chars} characters, so that is more than {chars // self.max_token_chars} "
                f"tokens, which cannot fit. Please reduce the length of the {param}.", param)


def message_texts(messages: Iterable[Any]) -> list[str]:
    """The text of every message's content (strings and text parts), for
    :meth:`PromptCharLimit.check`; other fields and part kinds are ignored here."""
    out: list[str] = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict):
                    out.extend(v for k in ("text", "refusal") if isinstance(v := part.get(k), str))
    return out
