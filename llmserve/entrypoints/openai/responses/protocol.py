"""Protocol of ``/v1/responses`` (OpenAI's Responses API, as vLLM serves it).

The request keeps OpenAI's field names (``input``, ``instructions``,
``max_output_tokens``, ``text.format``, flat function ``tools``, ``tool_choice``,
``previous_response_id``, ``store``, ``background``...) plus a few of vLLM's sampling
extras (``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``ignore_eos``,
``priority``, ``structured_outputs``: vLLM's Responses takes it too). The
response object and its output items follow ``openai.types.responses`` (the official
client validates them with ``Response.model_validate``; the tests do too).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field

from llmserve.entrypoints.chat_utils import check_json_types
from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from llmserve.entrypoints.openai.common.protocol import (
    MAX_TEMPERATURE,
    check_max_logprobs,
    Int64,
    JSONFloat,
    OpenAIBaseModel,
    OpenAIRequestPart,
    REASONING_EFFORTS,
    random_uuid,
)
from llmserve.entrypoints.openai.common.service_fields import OpenAIServiceFields, Verbosity
from llmserve.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

# OpenAI's ``include`` values (``openai.types.responses.ResponseIncludable``). Only
# ``message.output_text.logprobs`` changes the output here; the others ask for parts of
# items this server never produces (search, image and code-interpreter calls, encrypted
# reasoning), so, as OpenAI does for a request without those items and as vLLM does,
# they are accepted and ignored. Any other value is a 400 naming ``include``.
INCLUDE_OUTPUT_LOGPROBS = "message.output_text.logprobs"
INCLUDE_VALUES = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
    "web_search_call.action.sources", "web_search_call.results"})
# OpenAI fields whose request this server cannot honour and whose absence would change
# the answer (README "Request fields"): each is a 400 naming it, never dropped.
REFUSED_FIELDS = {
    "conversation": "Conversations (the Conversations API's stored items) are not kept by this server: send the "
                    "earlier turns in `input`, or continue with `previous_response_id`.",
    "prompt": "Stored prompt templates (`prompt.id`, `prompt.variables`) are not kept by this server: send the "
              "prompt's text in `instructions` and `input`.",
    "max_tool_calls": "This server runs no built-in tools and does not cap the model's function calls: leave out "
                      "`max_tool_calls`.",
}


class ResponseTextFormat(OpenAIRequestPart):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "description", "strict"}`` (flat, unlike
    chat's ``response_format.json_schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseTextConfig(OpenAIRequestPart):
    """``text``: the output's ``format`` and OpenAI's ``verbosity`` (no effect here)."""

    format: Optional[ResponseTextFormat] = None
    verbosity: Optional[Verbosity] = None


class ResponsesRequest(OpenAIServiceFields):
    """``POST /v1/responses``.

    ``input``: a string (one user message) or a list of input items: messages
    (``{"role", "content"}`` with a string or ``input_text``/``output_text`` parts),
    ``function_call`` and ``function_call_output`` items, and ``reasoning`` items (not
    shown to the template, as vLLM). ``tools``: function tools ``{"type": "function",
    "name", "description", "parameters", "strict"}``; other tool types (``web_search``,
    ``namespace``, ``custom``...) are dropped or refused by
    ``--responses-unsupported-tools``. ``conversation``, ``prompt`` and
    ``max_tool_calls`` are a 400 (REFUSED_FIELDS); any field OpenAI's API does not
    have is ignored with a warning (README "Request fields"). Checks that need no model are
    :meth:`check`; the rest (tools, input items, context length) raise
    SamplingParamsError naming the field when the request is built.
    """

    model: Optional[str] = None
    input: Union[str, Annotated[list[Any], Field(max_length=MAX_MESSAGES)]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int64] = None
    temperature: Optional[JSONFloat] = None
    top_p: Optional[JSONFloat] = None
    text: Optional[ResponseTextConfig] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    user: Optional[str] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[Int64] = None  # 0..20 alternatives per token, with include logprobs
    store: Optional[bool] = True  # the other OpenAIServiceFields: checked, then ignored
    background: Optional[bool] = False
    stream: Optional[bool] = False
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None  # {"effort": ...}: passed to the chat template
    truncation: Optional[Literal["auto", "disabled"]] = "disabled"
    # vLLM extras
    top_k: Optional[Int64] = None
    min_p: Optional[JSONFloat] = None
    repetition_penalty: Optional[JSONFloat] = None
    seed: Optional[Int64] = None
    stop: Optional[Union[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)],
                         Annotated[list[Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]],
                                   Field(max_length=MAX_STOP_STRINGS)]]] = None
    ignore_eos: bool = False
    priority: Int64 = 0
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's constraint object, as on chat and completions (common/structured.py); it was an
    # ignored unknown field here, so a client's regex/choice silently ran unconstrained
    structured_outputs: Optional[dict[str, Any]] = None
    # OpenAI fields this server refuses (REFUSED_FIELDS): declared so they are never an
    # ignored unknown field
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    max_tool_calls: Optional[Any] = None

    def check(self) -> None:
        """Checks that need no model. Raises SamplingParamsError naming the field."""
        for name, why in REFUSED_FIELDS.items():
            if getattr(self, name) is not None:
                raise SamplingParamsError(f"`{name}` is not supported by this server. {why}", name)
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise SamplingParamsError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}.",
                                      "max_output_tokens")
        if self.temperature is not None and not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}.",
                                      "temperature")
        if isinstance(self.input, list) and not self.input:
            raise SamplingParamsError("input must not be an empty list.", "input")
        unknown = sorted(set(self.include or ()) - INCLUDE_VALUES)
        if unknown:
            raise SamplingParamsError(f"include: unknown value(s) {unknown}; expected some of "
                                      f"{sorted(INCLUDE_VALUES)}.", "include")
        check_max_logprobs(self.top_logprobs, "top_logprobs")
        if self.background and not self.store:
            raise SamplingParamsError("background responses must be stored: set store to true.", "store")
        if self.reasoning is not None:
            # a plain object (passed back in the response as sent): its fields' JSON types
            # here, "summary": 5 was taken (200)
            check_json_types(self.reasoning, {"effort": (str,), "summary": (str,), "generate_summary": (str,)},
                             "reasoning")
            if self.reasoning.get("effort") not in (None, *REASONING_EFFORTS):
                raise SamplingParamsError(f"reasoning.effort: must be one of {', '.join(REASONING_EFFORTS)}.",
                                          "reasoning.effort")

    @property
    def include_output_logprobs(self) -> bool:
        """``include`` asks for ``message.output_text.logprobs`` (vLLM's
        ``is_include_output_logprobs``)."""
        return bool(self.include) and INCLUDE_OUTPUT_LOGPROBS in self.include

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """The chat template's extra variables: ``chat_template_kwargs`` plus
        ``reasoning_effort`` from ``reasoning.effort`` (as chat's ``reasoning_effort``)."""
        effort = (self.reasoning or {}).get("effort")
        if effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": effort, **(self.chat_template_kwargs or {})}

    def to_sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """SamplingParams of the request (vLLM's ``ResponsesRequest.to_sampling_params``);
        a field left out takes the model's generation-config default, else OpenAI's.
        Token logprobs (``top_logprobs`` alternatives) are sampled only when ``include``
        asks for ``message.output_text.logprobs``, as vLLM.
        ``max_output_tokens`` None leaves the budget to the engine's InputProcessor."""
        def pick(name: str, builtin: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, builtin)

        return SamplingParams(
            max_tokens=self.max_output_tokens, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.include_output_logprobs else None,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


class ResponsesInputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens`` (the ``openai`` client's
    ``responses.input_tokens.count``): the prompt part of a Responses request, whose
    ``input`` may be left out when ``previous_response_id`` gives the conversation."""

    input: Optional[Union[str, Annotated[list[Any], Field(max_length=MAX_MESSAGES)]]] = None  # type: ignore[assignment]


class ResponsesInputTokens(OpenAIBaseModel):
    """OpenAI's answer to ``POST /v1/responses/input_tokens``: the prompt's tokens as
    ``/v1/responses`` would render it (instructions, history, input, tools)."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


# ----------------------------------------------------------------------------- output
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    """An assistant ``message`` output item."""

    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    """A ``function_call`` output item: ``arguments`` is JSON text; ``call_id`` pairs it
    with the client's ``function_call_output``."""

    id: str = Field(default_factory=lambda: f"fc_{random_uuid()}")
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """A ``reasoning`` output item (with ``--reasoning-parser``): the text in ``content``."""

    id: str = Field(default_factory=lambda: f"rs_{random_uuid()}")
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = Union[OutputMessage, FunctionCallItem, ReasoningItem]


class InputTokensDetails(OpenAIBaseModel):
    """``cached_tokens``: prompt tokens served from the prefix cache;
    ``cache_write_tokens``: the others (computed by this request, and cached)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    """Token counts: the prompt (``input_tokens``, prefix-cache hits in
    ``input_tokens_details.cached_tokens``), the output, and their sum."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str

    @classmethod
    def of(cls, status: int, message: str, code: Union[int, str, None] = None) -> "ResponseError":
        """The ``error`` of a failed response from the HTTP status its failure maps to
        (common/errors.py), in OpenAI's codes (``openai.types.responses.ResponseError``:
        its own types refuse any other): ``rate_limit_exceeded`` (429); ``server_error``
        for 5xx and for the request's own ``X-Request-Timeout`` running out (408: OpenAI's
        codes have no generic timeout, and a timeout is no refused request; the message and
        the stream's ``error`` event, code "408" as the non-streamed 408, say which);
        ``invalid_prompt`` for any other refusal of the request (4xx). ``code``: the error
        body's own code; a string one (``context_length_exceeded``, which OpenAI's failed
        responses carry and Codex CLI tests) is kept as it is."""
        if isinstance(code, str):
            return cls(code=code, message=message)
        return cls(code=_ERROR_CODES.get(status, "server_error" if status >= 500 else "invalid_prompt"),
                   message=message)


_ERROR_CODES = {408: "server_error", 429: "rate_limit_exceeded"}


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponsesResponse(OpenAIBaseModel):
    """The ``response`` object (``openai.types.responses.Response``)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus = "in_progress"
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    store: bool = True
    background: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    top_logprobs: Optional[int] = None
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None

    @property
    def output_text(self) -> str:
        """The text of every output_text part (the openai client's ``output_text``)."""
        return "".join(c.text for item in self.output if isinstance(item, OutputMessage) for c in item.content)


class DeletedResponse(OpenAIBaseModel):
    """``DELETE /v1/responses/{id}``'s body."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
