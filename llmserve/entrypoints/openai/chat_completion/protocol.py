"""Protocol of ``POST /v1/chat/completions`` (OpenAI's chat completion objects plus
vLLM's chat extras: add_generation_prompt, continue_final_message, chat_template, ...)."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES
from llmserve.entrypoints.openai.common.protocol import (
    ChatCompletionLogProbs,
    ChatMessageParam,
    Int64,
    OpenAIBaseModel,
    PromptLogprobs,
    ReasoningEffort,
    SamplingRequest,
    UsageInfo,
    check_max_logprobs,
    random_uuid,
    timing_field,
)
from llmserve.entrypoints.openai.common.service_fields import OpenAIServiceFields, Verbosity
from llmserve.entrypoints.openai.chat_completion.openai_fields import check_openai_only_fields
# The parsed-output types live on the low floor shared by the parsers, the engine's
# structured outputs and every front door; re-exported here under vLLM's paths.
from llmserve.parsing_types import (  # noqa: F401  (re-exports)
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from llmserve.sampling_params import SamplingParams, SamplingParamsError


class ChatCompletionRequest(SamplingRequest, OpenAIServiceFields):
    """``POST /v1/chat/completions`` (OpenAI fields + vLLM's chat extras). ``metadata``,
    ``store``, ``service_tier``... are OpenAIServiceFields: checked, then ignored."""

    messages: list[ChatMessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    tools: Optional[list[Any]] = None  # checked by tool_calling.check_tools (400s naming `tools`)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    # vLLM extra: False leaves the reasoning out of the response
    include_reasoning: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: bool = False
    # OpenAI fields refused or passed to the template (openai_fields.py)
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    web_search_options: Optional[dict[str, Any]] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    reasoning_effort: Optional[ReasoningEffort] = None
    verbosity: Optional[Verbosity] = None  # no effect here (as Responses' text.verbosity)

    def requested_max_tokens(self) -> Optional[int]:
        """``max_completion_tokens`` wins over the legacy ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_openai_budget(self) -> None:
        """``/v1/chat/completions`` only (OpenAI: ">= 1"; vLLM: "at least 1"): fewer than 1
        output token is a 400 unless ``echo`` (which scores the prompt) allows 0. Runs
        before :meth:`check`, whose shared "at least 0" would otherwise answer a negative
        value and send the client to 0, itself a 400 here (fresh-user trial). The other
        front doors keep their own rules (Ollama's ``num_predict: 0``). Raises
        SamplingParamsError."""
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1 and not self.echo:
                raise SamplingParamsError(f"Invalid '{name}': expected a value >= 1, got {value} (0 is allowed "
                                          "only with echo, which returns the prompt's logprobs).", name)

    def check(self) -> None:
        """Request-level checks (no prompt needed). Raises SamplingParamsError."""
        self.check_common()
        check_openai_only_fields(self)
        if self.max_completion_tokens is not None and self.max_completion_tokens < 0:
            raise SamplingParamsError(
                f"max_completion_tokens must be at least 0, got {self.max_completion_tokens}.",
                "max_completion_tokens")
        check_max_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamsError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamsError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
                "continue_final_message")
        from llmserve.entrypoints.openai.chat_completion.tool_calling import check_tools

        check_tools(self)

    def to_sampling_params(self, max_tokens: Optional[int], defaults: dict[str, Any]) -> SamplingParams:
        """Map the OpenAI fields to SamplingParams (vLLM's ``to_sampling_params``).

        max_tokens: the output budget (``requested_max_tokens()``; None leaves it to the
        engine's InputProcessor: the room left in the context, capped by the model's
        default budget). defaults: the model's generation-config defaults.
        Raises SamplingParamsError (param set) for out-of-range fields; context-length
        checks are the engine's (raised from ``AsyncLLM.generate``).
        """
        kwargs = self.sampling_kwargs(defaults)
        kwargs["max_tokens"] = max_tokens
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**kwargs)


class ChatMessage(OpenAIBaseModel):
    """The assistant's reply. ``reasoning`` (vLLM's current name) and
    ``reasoning_content`` (its former name, still read by many clients) both carry the
    reasoning text when a reasoning parser is set; ``tool_calls`` is [] when none (vLLM)."""

    role: str = "assistant"
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_validator(mode="after")
    def _both_reasoning_names(self) -> "ChatMessage":
        if self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self


class ChatCompletionResponseChoice(OpenAIBaseModel):
    """One choice; ``token_ids`` with vLLM's ``return_token_ids``."""

    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM's extras, at the top level in chat: prompt_logprobs, prompt_token_ids
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None
    metrics: Optional[dict[str, Any]] = timing_field()  # vLLM's include_metrics
    timings: Optional[dict[str, Any]] = timing_field()  # llama.cpp's timings_per_token


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One chunk; with ``return_token_ids`` the first chunk carries ``prompt_token_ids``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None
    metrics: Optional[dict[str, Any]] = timing_field()
    timings: Optional[dict[str, Any]] = timing_field()
