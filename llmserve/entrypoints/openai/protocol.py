"""Pydantic models of the OpenAI-compatible HTTP API (vLLM's ``entrypoints/openai/protocol.py``).

Requests keep OpenAI's field names plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, ...). Each generation request converts itself
to a :class:`~llmserve.sampling_params.SamplingParams` with ``to_sampling_params``, which
raises :class:`~llmserve.sampling_params.SamplingParamsError` (a ValueError with ``param``)
on out-of-range values, so the server answers 400 naming the field.

Unknown request fields are accepted and ignored, as vLLM and OpenAI do; fields whose
meaning llmserve cannot honour (``suffix``, ``tools`` with a tool choice, structured
``response_format``) are rejected with a 400 instead of being silently ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from llmserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

# vLLM's default ``max_logprobs``: the most top logprobs one position may ask for.
MAX_LOGPROBS = 20
# OpenAI's documented range for ``temperature``.
MAX_TEMPERATURE = 2.0
# The most completions one request may ask for (``n``; per prompt for completions).
MAX_N = 1024

# Integers that cross the process boundary must fit in 64 bits (vLLM bounds ``seed`` alike).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def random_uuid() -> str:
    """A random 32-hex-digit id (used in request ids such as ``chatcmpl-<uuid>``)."""
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Base of all API models: unknown fields are allowed (and ignored)."""

    model_config = ConfigDict(extra="allow")


class OpenAIRequestModel(OpenAIBaseModel):
    """Base of request bodies: NaN and Infinity are rejected (Python's json accepts them)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# ----------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    """The inner object of an OpenAI error body. ``code`` is the HTTP status code."""

    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ----------------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    """One entry of ``GET /v1/models``; ``created`` is a Unix time in seconds."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ----------------------------------------------------------------------------- usage
class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    """Token counts of one request: prompt, completion (all choices) and their sum."""

    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: one last chunk with ``choices: []`` and the usage.
    ``continuous_usage_stats`` (vLLM): running usage on every chunk."""

    include_usage: Optional[bool] = True
    continuous_usage_stats: Optional[bool] = False


# ----------------------------------------------------------------------------- sampling
class _SamplingRequest(OpenAIRequestModel):
    """Sampling fields shared by chat and completions (OpenAI + vLLM extras).

    None means "not given": the server then uses the model's generation_config default
    (when it has one) or OpenAI's default.
    """

    model: Optional[str] = None
    n: Optional[Int64] = 1
    max_tokens: Optional[Int64] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[Int64] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None
    # vLLM extras
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[Int64]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[list[Int64]] = None
    bad_words: Optional[list[str]] = None
    priority: Int64 = 0

    def check_common(self) -> None:
        """Checks that do not need the prompt. Raises SamplingParamsError (param set)."""
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options can only be set if stream is true.", "stream_options")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise SamplingParamsError(f"max_tokens must be at least 0, got {self.max_tokens}.", "max_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}.", "temperature")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n must be between 1 and {MAX_N} (this server's limit), got {self.n}.", "n")
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            raise SamplingParamsError(
                f"response_format of type {rf.get('type')!r} is not supported by this server "
                "(structured outputs are not available).", "response_format")

    def _sampling_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        def pick(name: str, builtin: Any) -> Any:
            value = getattr(self, name)
            if value is not None:
                return value
            return defaults.get(name, builtin)

        logit_bias = None
        if self.logit_bias:
            logit_bias = {}
            for k, v in self.logit_bias.items():
                try:
                    logit_bias[int(k)] = float(v)
                except ValueError as e:
                    raise SamplingParamsError(f"logit_bias keys must be token ids, got {k!r}.", "logit_bias") from e
        return dict(
            n=self.n if self.n is not None else 1,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


def _check_max_logprobs(value: Optional[int], param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise SamplingParamsError(f"{param} must be between 0 and {MAX_LOGPROBS}, got {value}.", param)


# ----------------------------------------------------------------------------- chat
class ChatMessageParam(OpenAIBaseModel):
    """One input message: ``content`` is a string, a list of content parts
    (``{"type": "text", "text": ...}``), or null (assistant messages with tool calls)."""

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions`` (OpenAI fields + vLLM's chat extras)."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def requested_max_tokens(self) -> Optional[int]:
        """``max_completion_tokens`` wins over the legacy ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self) -> None:
        """Request-level checks (no prompt needed). Raises SamplingParamsError."""
        self.check_common()
        if self.max_completion_tokens is not None and self.max_completion_tokens < 0:
            raise SamplingParamsError(
                f"max_completion_tokens must be at least 0, got {self.max_completion_tokens}.",
                "max_completion_tokens")
        _check_max_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamsError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamsError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
                "continue_final_message")
        if self.tools and self.tool_choice != "none":
            raise SamplingParamsError(
                "Tool calling is not supported by this server yet; send tool_choice='none' or no tools.",
                "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise SamplingParamsError("tool_choice requires tools, which this server does not support yet.",
                                      "tool_choice")

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        """Build SamplingParams; ``max_tokens`` is already resolved against the context.

        Raises SamplingParamsError (param set) for out-of-range fields.
        """
        kwargs = self._sampling_kwargs(defaults)
        kwargs["max_tokens"] = max_tokens
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**kwargs)


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionLogProb(OpenAIBaseModel):
    """One candidate token: text, natural-log probability (finite) and UTF-8 bytes."""

    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    """A streamed message fragment; fields that are None are left out of the JSON."""

    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # noqa: ANN001
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ----------------------------------------------------------------------------- completions
PromptType = Union[list[int], list[list[int]], str, list[str]]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids or a list of token-id lists. ``max_tokens`` defaults to 16 (OpenAI's legacy default)."""

    prompt: PromptType
    echo: Optional[bool] = False
    logprobs: Optional[Int64] = None
    suffix: Optional[str] = None
    best_of: Optional[Int64] = None
    add_special_tokens: bool = True
    prompt_logprobs: Optional[Int64] = None

    def check(self) -> None:
        """Request-level checks. Raises SamplingParamsError (param set)."""
        self.check_common()
        if self.suffix is not None:
            raise SamplingParamsError("suffix is not supported by this server.", "suffix")
        _check_max_logprobs(self.logprobs, "logprobs")
        _check_max_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise SamplingParamsError("best_of is not supported (it must equal n).", "best_of")

    def to_sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        """Build SamplingParams. With ``echo`` and ``logprobs`` the prompt's logprobs are
        asked for too (OpenAI's echo semantics). Raises SamplingParamsError."""
        kwargs = self._sampling_kwargs(defaults)
        kwargs["max_tokens"] = max_tokens
        kwargs["logprobs"] = self.logprobs
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        kwargs["prompt_logprobs"] = prompt_logprobs
        return SamplingParams(**kwargs)


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions logprobs: four parallel lists, one entry per token. The first
    prompt token (with echo) has ``None`` logprob and top_logprobs."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ----------------------------------------------------------------------------- tokenizer routes
class TokenizeRequest(OpenAIRequestModel):
    """``POST /tokenize``: exactly one of ``prompt`` (plain text) or ``messages`` (rendered
    through the chat template first). ``add_special_tokens`` defaults to True for a prompt
    and False for messages (the template writes the special tokens), as in vLLM."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageParam]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise SamplingParamsError("Exactly one of `prompt` or `messages` must be given.",
                                      "prompt" if self.prompt is None else "messages")
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
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ----------------------------------------------------------------------------- not yet served
class ResponsesRequest(OpenAIRequestModel):
    """``POST /v1/responses``: only parsed far enough to check the model and the input
    length; the endpoint itself is not served yet."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None


class EmbeddingRequest(OpenAIRequestModel):
    """``POST /v1/embeddings``: parsed to check the model; generate models answer 400."""

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Optional[str] = "float"
