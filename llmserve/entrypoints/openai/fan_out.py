"""How many engine requests (sequences) one HTTP call becomes: its fan-out, as admission
control counts it (admission.py).

One call can ask for many sequences: ``/v1/completions`` with a list of prompts and
``n`` / ``best_of`` (each prompt runs ``max(n, best_of)`` sequences), chat with ``n``,
the pooling routes (``/v1/embeddings``, ``/pooling``, ``/classify``, Ollama's
``/api/embed``) with a list ``input``, ``/score`` and ``/rerank`` with lists of texts or
documents. Counted as one request, a call of 1024 prompts with ``n=16`` (16,384 engine
requests, within the documented limits) was admitted as one, filled the engine's queue
and held a concurrent 4-token chat for 117 s (tester's fanout.py). The count is read
from the raw JSON body before the route parses it (the body has already arrived whole:
BodyLimitMiddleware), so it costs one msgspec decode of a body the route decodes again;
a body that is not JSON, whose fields have the wrong type, or past a documented limit
(``MAX_PROMPTS_PER_REQUEST``, ``MAX_N``) counts as one sequence (the route answers it
with its own 400). Anthropic's ``/v1/messages``, Ollama's chat and
generate, the Responses API and speech-to-text run one sequence per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import msgspec

from llmserve.entrypoints.openai.common.limits import MAX_N, MAX_PROMPTS_PER_REQUEST

# Fields holding a list of prompts / inputs / documents, in the order the routes read them.
_LIST_FIELDS = ("prompt", "input", "documents", "items", "text_2", "data_2", "text_1", "data_1", "queries")
# Fields giving sequences per prompt (best_of must equal n on /v1/completions, but a
# body with best_of > n asks for best_of sequences until the route refuses it).
_PER_PROMPT_FIELDS = ("n", "best_of")
# Routes that run one sequence per call whatever their lists say (the Responses API's
# ``input`` is a list of conversation items, not of prompts).
SINGLE_SEQUENCE_PATHS = frozenset({"/v1/responses", "/v1/messages", "/api/chat", "/api/generate",
                                   "/v1/audio/transcriptions", "/v1/audio/translations"})


@dataclass(frozen=True)
class FanOut:
    """A call's fan-out. ``prompts``: prompts (or inputs, documents, score pairs) in the
    call, ``list_field`` the body field holding them (None: one prompt); ``per_prompt``:
    sequences per prompt, ``per_prompt_field`` the field that set it ("n" or "best_of";
    None: 1). ``sequences`` = prompts × per_prompt, the engine requests it becomes."""

    prompts: int = 1
    list_field: Optional[str] = None
    per_prompt: int = 1
    per_prompt_field: Optional[str] = None

    @property
    def sequences(self) -> int:
        return self.prompts * self.per_prompt

    def describe(self) -> str:
        """The fields behind the count, for error messages, e.g. "`prompt` (1024 prompts)
        × `n` (16)"."""
        parts = []
        if self.list_field is not None:
            parts.append(f"`{self.list_field}` ({self.prompts} items)")
        if self.per_prompt_field is not None:
            parts.append(f"`{self.per_prompt_field}` ({self.per_prompt})")
        return " × ".join(parts) or "one sequence"

    def field(self, capacity: int) -> str:
        """The field to name in a 400 against ``capacity`` sequences: the per-prompt count
        when it alone exceeds the capacity, else the list (or the per-prompt field when
        there is no list)."""
        if self.per_prompt_field is not None and (self.per_prompt > capacity or self.list_field is None):
            return self.per_prompt_field
        return self.list_field or "n"


ONE = FanOut()


def _list_length(value: Any) -> int:
    """Prompts in a ``prompt`` / ``input`` value: a list of strings, of token-id lists or
    of objects counts its items; a string, one token-id list (list of ints) or anything
    else counts 1."""
    if not isinstance(value, list) or not value:
        return 1
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return 1  # one prompt given as token ids
    return len(value)


def _positive_int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else None


def fan_out_of(body: bytes, path: str = "") -> FanOut:
    """The fan-out of a JSON request ``body`` to route ``path`` (see the module
    docstring); :data:`ONE` for a route of :data:`SINGLE_SEQUENCE_PATHS` or a body that
    is not a JSON object. Score pairs count as the longer side (one text
    against N documents is N pairs, two lists of N are N pairs)."""
    if path in SINGLE_SEQUENCE_PATHS:
        return ONE
    try:
        parsed = msgspec.json.decode(body) if body else None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return ONE  # not JSON, or nested past msgspec's depth: the route's own guard answers it (400)
    if not isinstance(parsed, dict):
        return ONE
    prompts, list_field = 1, None
    for name in _LIST_FIELDS:
        count = _list_length(parsed.get(name))
        if count > prompts:
            prompts, list_field = count, name
    per_prompt, per_prompt_field = 1, None
    for name in _PER_PROMPT_FIELDS:
        count = _positive_int(parsed.get(name))
        if count is not None and count > per_prompt:
            per_prompt, per_prompt_field = count, name
    if prompts > MAX_PROMPTS_PER_REQUEST or per_prompt > MAX_N:
        return ONE  # past a documented limit: the route's own 400 names it, before any engine request
    return FanOut(prompts, list_field, per_prompt, per_prompt_field)
