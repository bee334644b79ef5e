"""Logprob formatting for the API: token strings, UTF-8 bytes and finite numbers.

JSON has no ``-Infinity``: a logprob of -inf (a masked token) is written as -9999.0, as
vLLM does, so every body is strict JSON. Token strings follow OpenAI: a token whose bytes
are not valid UTF-8 on their own (part of a multi-byte character) is written as
``"bytes:\\xe2\\x80"``; chat logprobs carry the token's raw bytes in ``bytes``.
"""
from __future__ import annotations

import codecs
import math
import re
from typing import Any, Optional, Sequence

from llmserve.entrypoints.openai.common.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
)

MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def finite_logprob(value: Optional[float]) -> float:
    """Map a logprob to a finite float: -inf and NaN become -9999.0 (vLLM's value)."""
    if value is None or math.isnan(value):
        return MIN_LOGPROB
    if math.isinf(value):
        return MIN_LOGPROB if value < 0 else 0.0
    return max(float(value), MIN_LOGPROB)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class TokenFormatter:
    """Per-tokenizer cache of each token id's API string and raw bytes.

    ``text(id)`` is the token's text as it appears in decoded output (special tokens
    kept), or ``"bytes:\\x.."`` when the token is part of a multi-byte character.
    ``raw_bytes(id)`` is the token's exact bytes.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        special = getattr(tokenizer, "all_special_ids", None) or []
        self._special = set(int(i) for i in special)

    def _raw(self, token_id: int) -> Optional[bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:  # SentencePiece byte-fallback token
            return bytes([int(m.group(1), 16)])
        if piece and all(ch in _BYTE_DECODER for ch in piece):  # byte-level BPE
            return bytes(_BYTE_DECODER[ch] for ch in piece)
        return None

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if token_id in self._special:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entry = (text, list(text.encode("utf-8")))
        else:
            raw = self._raw(token_id)
            if raw is not None:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                entry = (text, list(raw))
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                text = piece.replace("\u2581", " ") if isinstance(piece, str) else ""
                if not text:
                    text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                entry = (text, list(text.encode("utf-8")))
        self._cache[token_id] = entry
        return entry

    def text(self, token_id: int) -> str:
        return self._entry(int(token_id))[0]

    def raw_bytes(self, token_id: int) -> list[int]:
        return self._entry(int(token_id))[1]


class TokenIdFormatter:
    """The formatter of ``return_tokens_as_token_ids`` (vLLM): every token is written
    ``token_id:N``, so clients can map logprobs back to ids whatever the tokenizer."""

    @staticmethod
    def text(token_id: int) -> str:
        return f"token_id:{int(token_id)}"

    def raw_bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("utf-8"))


def build_prompt_logprobs(fmt: Any, prompt_ids: Sequence[int],
                          prompt_logprobs: Optional[Sequence[Optional[dict[int, Any]]]],
                          num: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` of one prompt: None for the first token, then for each
    position a dict {token id: PromptLogprob} of the actual prompt token and the ``num``
    best candidates (the engine may hold more when echo asked for more). ``fmt`` writes
    ``decoded_token`` (a TokenFormatter or TokenIdFormatter)."""
    out: PromptLogprobs = []
    steps = list(prompt_logprobs or [])
    for i, tid in enumerate(prompt_ids):
        step = steps[i] if i < len(steps) else None
        if step is None:
            out.append(None)
            continue
        keep = {tid: step[tid]} if tid in step else {}  # the actual token first, as vLLM
        keep.update((t, lp) for t, lp in _ranked(step, num) if t not in keep)
        out.append({t: PromptLogprob(logprob=finite_logprob(lp.logprob), rank=lp.rank, decoded_token=fmt.text(t))
                    for t, lp in keep.items()})
    return out


def _ranked(step: dict[int, Any], num: int) -> list[tuple[int, Any]]:
    """The ``num`` best entries of one position's {token_id: Logprob}, by rank."""
    if num <= 0:
        return []
    items = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                 -finite_logprob(kv[1].logprob)))
    return items[:num]


class TextOffsets:
    """Where each token starts in the text its choice decodes to, in characters.

    A token holding part of a multi-byte character adds nothing until the token that
    completes the character, so the tokens of one character share its offset and the next
    token starts one character later (llama-cpp-python's fix of text_offset for
    multi-token characters, PR 1037). The length is that of the token's real text even
    when the API writes tokens as ``token_id:N`` (vLLM issue 19368). One instance per
    choice; a streamed choice keeps it across chunks, so a character split over two
    chunks is counted once.
    """

    def __init__(self, text_fmt: "TokenFormatter", start: int = 0):
        self._fmt = text_fmt
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = start

    def advance(self, token_id: int) -> int:
        """The offset of ``token_id`` (the characters decoded before it); moves past it."""
        at = self.offset
        self.offset += len(self._decoder.decode(bytes(self._fmt.raw_bytes(token_id))))
        return at


def build_completion_logprobs(
    fmt: TokenFormatter,
    token_ids: Sequence[int],
    top_logprobs: Sequence[Optional[dict[int, Any]]],
    num_output_top_logprobs: int,
    offsets: Optional[TextOffsets] = None,
) -> CompletionLogProbs:
    """Legacy completions logprobs for ``token_ids`` (prompt and/or generated).

    ``top_logprobs[i]`` is the engine's {token_id: Logprob} for position i (None for the
    first prompt token). Each ``top_logprobs`` entry of the result holds the chosen token
    and the ``num_output_top_logprobs`` best tokens. ``text_offset`` counts characters
    from the start of the choice's text, as ``offsets`` (a TextOffsets over the tokens'
    real text; a new one from 0 over ``fmt`` when not given) places them.
    """
    out = CompletionLogProbs()
    offsets = offsets if offsets is not None else TextOffsets(fmt)
    for tid, step in zip(token_ids, top_logprobs):
        token = fmt.text(tid)
        out.tokens.append(token)
        out.text_offset.append(offsets.advance(tid))
        if step is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        chosen = step.get(tid)
        out.token_logprobs.append(finite_logprob(chosen.logprob) if chosen is not None else MIN_LOGPROB)
        tops = {fmt.text(i): finite_logprob(lp.logprob) for i, lp in _ranked(step, num_output_top_logprobs)}
        if chosen is not None:
            tops.setdefault(token, finite_logprob(chosen.logprob))
        out.top_logprobs.append(tops)
    return out


def build_chat_logprobs(
    fmt: TokenFormatter,
    token_ids: Sequence[int],
    top_logprobs: Sequence[Optional[dict[int, Any]]],
    num_output_top_logprobs: int,
) -> ChatCompletionLogProbs:
    """Chat logprobs: one content entry per generated token with its ``top_logprobs``
    best alternatives (exactly ``num_output_top_logprobs`` when the engine sent that many)."""
    content = []
    for tid, step in zip(token_ids, top_logprobs):
        step = step or {}
        chosen = step.get(tid)
        content.append(ChatCompletionLogProbsContent(
            token=fmt.text(tid),
            logprob=finite_logprob(chosen.logprob) if chosen is not None else MIN_LOGPROB,
            bytes=fmt.raw_bytes(tid),
            top_logprobs=[
                ChatCompletionLogProb(token=fmt.text(i), logprob=finite_logprob(lp.logprob), bytes=fmt.raw_bytes(i))
                for i, lp in _ranked(step, num_output_top_logprobs)
            ],
        ))
    return ChatCompletionLogProbs(content=content)
