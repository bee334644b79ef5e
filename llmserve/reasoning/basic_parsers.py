"""Reasoning between ``<think>`` and ``</think>`` (vLLM's ``BaseThinkingReasoningParser``,
``DeepSeekR1ReasoningParser`` and ``Qwen3ReasoningParser``)."""
from __future__ import annotations

from typing import Any, Sequence

from llmserve.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager, ReasoningSplit


def _held_back(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class BaseThinkingReasoningParser(ReasoningParser):
    """Reasoning is the text before ``end_token``; a ``start_token`` at the start of the
    output is dropped (templates that open the block in the prompt leave it out).
    Raises ValueError when the tokenizer has no single token for either marker (vLLM)."""

    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        vocab = self.vocab
        self.start_token_id = vocab.get(self.start_token)
        self.end_token_id = vocab.get(self.end_token)
        if self.start_token_id is None or self.end_token_id is None:
            raise ValueError(f"{type(self).__name__} reasoning parser could not locate the think start/end "
                             f"tokens ({self.start_token!r}, {self.end_token!r}) in the tokenizer")

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """The last think marker in ``input_ids`` is the end marker."""
        for tok in reversed(input_ids):
            if tok == self.end_token_id:
                return True
            if tok == self.start_token_id:
                return False
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids after the last end marker ([] while reasoning)."""
        ids = list(input_ids)
        if self.end_token_id not in ids:
            return []
        return ids[len(ids) - ids[::-1].index(self.end_token_id):]

    def split(self, text: str, final: bool) -> ReasoningSplit:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(self.start_token):
            text = body[len(self.start_token):]
        elif not final and body and self.start_token.startswith(body):
            return ReasoningSplit("", "", False)  # may still be "<think>"
        elif not self.reasoning_by_default():
            # Thinking is off and no block was opened: all content, an end marker included.
            # Splitting at a late marker would turn text already streamed as content into
            # reasoning (the whole and the streamed splits would differ).
            return ReasoningSplit("", text, False)
        end = text.find(self.end_token)
        if end >= 0:
            return ReasoningSplit(text[:end], text[end + len(self.end_token):], True)
        keep = 0 if final else _held_back(text, self.end_token)
        return ReasoningSplit(text[:len(text) - keep], "", False)


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """DeepSeek-R1: the template opens ``<think>`` in the prompt, so all output up to
    ``</think>`` is reasoning (all of it when the output stops before the marker)."""


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """Qwen3: as DeepSeek-R1, except that with ``chat_template_kwargs.enable_thinking``
    false an output that does not open with ``<think>`` is all content (vLLM's current
    rule for an output without ``</think>``; a late ``</think>`` stays content too, so
    the streamed split equals the whole one)."""

    def reasoning_by_default(self) -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True))
