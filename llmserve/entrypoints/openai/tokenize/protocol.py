"""Protocol of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's tokenizer routes)."""
from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import Field, StrictInt

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES, MAX_PROMPT_TOKEN_IDS
from llmserve.entrypoints.openai.common.protocol import ChatMessageParam, OpenAIBaseModel, OpenAIRequestModel
from llmserve.sampling_params import SamplingParamsError


class TokenizeRequest(OpenAIRequestModel):
    """``POST /tokenize``: exactly one of ``prompt`` (plain text) or ``messages`` (rendered
    through the chat template first). ``add_special_tokens`` defaults to True for a prompt
    and False for messages (the template writes the special tokens), as in vLLM."""

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

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise SamplingParamsError("Exactly one of `prompt` or `messages` must be given.",
                                      "prompt" if self.prompt is None else "messages")
        if self.tools is not None:
            from llmserve.entrypoints.openai.chat_completion.tool_calling import check_tool

            for i, tool in enumerate(self.tools):
                check_tool(tool, i)
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamsError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
                "continue_final_message")


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIRequestModel):
    """``POST /detokenize``: ``tokens`` are JSON integers only (StrictInt: ``"1"``,
    ``true`` and ``1.0`` are a 400 naming ``tokens``, not coerced), at most
    MAX_PROMPT_TOKEN_IDS of them; the vocabulary range is checked by the handler."""

    model: Optional[str] = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
