"""vLLM's prompt TypedDicts (``vllm.inputs``): what ``LLM.generate`` and
``AsyncLLM.generate`` accept besides a plain string or a list of token ids.

They are plain dicts at run time, so ``{"prompt": ...}`` and ``TextPrompt(prompt=...)``
are the same prompt. Only the fields llmserve honours are declared.
"""
from __future__ import annotations

from typing import Union

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (special tokens added)."""

    prompt: str
    """The prompt text."""


class TokensPrompt(TypedDict):
    """A prompt already tokenized: its token ids go to the model as they are."""

    prompt_token_ids: list[int]
    """Token ids in [0, vocab_size)."""

    prompt: NotRequired[str]
    """The text of those ids (optional; used for logs and outputs, not re-tokenized)."""

    token_type_ids: NotRequired[list[int]]
    """Pooling models: each token's segment (0, then 1 for a text pair's second text), as
    the tokenizer returns them for a pair; a cross-encoder (BERT) embeds them."""


PromptType = Union[str, TextPrompt, TokensPrompt, list[int]]
"""Any single prompt ``LLM.generate`` takes."""
