"""Protocol of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's tokenizer routes, which
also take llama-server's request fields and give its answer keys; see TokenizeRequest)."""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import Field, StrictInt

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES, MAX_PROMPT_TOKEN_IDS
from llmserve.entrypoints.openai.common.protocol import ChatMessageParam, OpenAIBaseModel, OpenAIRequestModel
from llmserve.sampling_params import SamplingParamsError


class TokenizeRequest(OpenAIRequestModel):
    """``POST /tokenize``: exactly one of ``prompt`` (plain text) or ``messages`` (rendered
    through the chat template first). ``add_special_tokens`` defaults to True for a prompt
    and False for messages (the template writes the special tokens), as in vLLM.

    llama-server's fields: ``content`` is its name for ``prompt``; with it, ``add_special``
    (default False, llama-server's) adds the tokenizer's special tokens, ``parse_special``
    (default True) reads special-token text as those tokens, and ``with_pieces`` answers
    ``tokens`` as ``{"id", "piece"}`` objects (the piece a string, or its bytes when they
    are not UTF-8 on their own)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessageParam], Field(max_length=MAX_MESSAGES)]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None  # shown to the chat template, as in a chat request
    return_token_strs: bool = False
    content: Optional[str] = None
    add_special: Optional[bool] = None
    parse_special: bool = True
    with_pieces: bool = False

    def check(self) -> None:
        if self.content is not None:
            if self.prompt is not None or self.messages is not None:
                raise SamplingParamsError("Give the text as `prompt` or as `content` (llama-server's name), not "
                                          "both, and not with `messages`.", "content")
            if self.add_special_tokens is not None:
                raise SamplingParamsError("With `content` (llama-server's request), special tokens are asked "
                                          "for with `add_special`, not `add_special_tokens`.", "add_special_tokens")
            return
        for name in ("add_special", "with_pieces"):
            if getattr(self, name) not in (None, False):
                raise SamplingParamsError(f"`{name}` is llama-server's field: it goes with `content`, not "
                                          "`prompt` or `messages`.", name)
        if not self.parse_special:
            raise SamplingParamsError("`parse_special` is llama-server's field: it goes with `content`, not "
                                      "`prompt` or `messages`.", "parse_special")
        if (self.prompt is None) == (self.messages is None):
            raise SamplingParamsError("Exactly one of `prompt` (or llama-server's `content`) or `messages` must "
                                      "be given.", "prompt" if self.prompt is None else "messages")
        if self.tools is not None:
            from llmserve.entrypoints.openai.chat_completion.tool_calling import check_tool

            for i, tool in enumerate(self.tools):
                check_tool(tool, i)
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamsError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
                "continue_final_message")


class TokenPiece(OpenAIBaseModel):
    """llama-server's ``with_pieces`` entry."""

    id: int
    piece: Union[str, list[int]]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: Union[list[int], list[TokenPiece]]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIRequestModel):
    """``POST /detokenize``: ``tokens`` are JSON integers only (StrictInt: ``"1"``,
    ``true`` and ``1.0`` are a 400 naming ``tokens``, not coerced), at most
    MAX_PROMPT_TOKEN_IDS of them; the vocabulary range is checked by the handler."""

    model: Optional[str] = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


class DetokenizeResponse(OpenAIBaseModel):
    """vLLM's ``prompt``, and the same text as llama-server's ``content``."""

    prompt: str
    content: str
