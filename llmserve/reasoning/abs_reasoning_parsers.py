"""The reasoning-parser interface and registry (vLLM's ``ReasoningParser`` /
``ReasoningParserManager``).

A reasoning parser splits a reasoning model's output into its reasoning text and the
answer (content). The engine asks :meth:`ReasoningParser.is_reasoning_end` of the token
ids so far to know when a grammar starts to apply; the server splits text whole
(:meth:`ReasoningParser.extract_reasoning`) or streamed
(:meth:`ReasoningParser.extract_reasoning_streaming`) into the shared
:class:`~llmserve.parsing_types.DeltaMessage`. This module imports nothing of the server,
so the engine process can use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from llmserve.parser_registry import ParserRegistry
from llmserve.parsing_types import DeltaMessage


@dataclass(frozen=True)
class ReasoningSplit:
    """``reasoning`` and ``content`` text of an output so far, and whether the
    reasoning has ended."""

    reasoning: str
    content: str
    ended: bool


class ReasoningParser:
    """Base of the reasoning parsers.

    tokenizer: the model's tokenizer; kwargs: vLLM's ``chat_template_kwargs`` (the
    request's, e.g. ``{"enable_thinking": False}``).
    """

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs: dict[str, Any] = dict(kwargs.get("chat_template_kwargs") or {})

    @property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    def reasoning_by_default(self) -> bool:
        """Whether output that opens no reasoning block is reasoning (True) or content
        (False: the request switched thinking off). A structured-output grammar waits for
        the end of the reasoning only when this is True (and the prompt did not close it)."""
        return True

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """True when the reasoning has ended in ``input_ids`` (prompt and output ids)."""
        raise NotImplementedError

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids of ``input_ids`` (output ids) after the reasoning."""
        raise NotImplementedError

    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Reasoning and content of ``text``; unless ``final``, text that may be the
        start of a marker is held back. Monotone in ``text`` (each part of a prefix's
        split is a prefix of the longer text's)."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole output; None for an empty part."""
        s = self.split(model_output, final=True)
        return s.reasoning or None, s.content or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> Optional[DeltaMessage]:
        """The reasoning and content that ``delta_text`` adds (a DeltaMessage with
        ``reasoning``/``content``), or None when nothing new is certain yet."""
        return self._delta(self.split(previous_text, final=False), self.split(current_text, final=False))

    def flush_streaming(self, text: str) -> Optional[DeltaMessage]:
        """At the end of a stream: what was held back (a DeltaMessage or None)."""
        return self._delta(self.split(text, final=False), self.split(text, final=True))

    @staticmethod
    def _delta(before: ReasoningSplit, after: ReasoningSplit) -> Optional[DeltaMessage]:
        reasoning = after.reasoning[len(before.reasoning):]
        content = after.content[len(before.content):]
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)


class ReasoningParserManager(ParserRegistry):
    """Registry of reasoning parsers by name (vLLM's ``ReasoningParserManager``)."""

    kind = "reasoning parser"
    _registry: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class registered as ``name``. Raises KeyError naming the known ones."""
        return cls._lookup(name)
