"""Protocol of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``).

Field names and shapes are Anthropic's (https://docs.anthropic.com/en/api/messages). The
request models check types and ranges (a 400 naming the field, in Anthropic's error body
through :func:`anthropic_error_body`); the meaning of each content block is mapped in
``conversion.py``. Unknown fields are accepted and ignored with a warning logged once
per field name (the server's one policy, ``OpenAIRequestModel``): Claude Code sends
``context_management``, ``output_config`` and more that change nothing a local model
can do. ``cache_control`` (on the request, every block and tool), ``metadata``,
``service_tier``, ``speed`` and ``inference_geo`` are accepted and change nothing (the
prefix cache reuses any shared prefix by itself), but their values are checked as
Anthropic checks them (``accepted_fields.py``).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator

from llmserve.entrypoints.openai.common.limits import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_STRING_CHARS, \
    MAX_STOP_STRINGS
from llmserve.entrypoints.openai.common.protocol import (Int64, JSONFloat, JSONInt, OpenAIBaseModel, OpenAIRequestModel,
                                                         OpenAIRequestPart, random_uuid)

# Block lists: at most MAX_CONTENT_PARTS blocks in one message or in ``system``.
Blocks = Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)]
StopSequence = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]


class AnthropicMessageParam(OpenAIRequestPart):
    """One input message. ``role`` "system" is Anthropic's mid-conversation system message
    (``anthropic.types.SystemMessageParam`` in the SDK's MessageParam since 2.x; Claude
    Code 2.1.197 sends one after the first user turn); it becomes a system message."""

    role: Literal["user", "assistant", "system"]
    content: Union[str, Blocks]


class AnthropicToolParam(OpenAIRequestPart):
    """A client tool: ``name``, ``description``, ``input_schema`` (a JSON schema of the
    ``input`` object). ``type`` is absent or "custom" for client tools; Anthropic's
    server tools (``web_search_...``, ``bash_...``) are refused in ``conversion.py``."""

    name: str
    description: Optional[str] = None
    input_schema: Optional[dict[str, Any]] = None
    type: Optional[str] = None
    cache_control: Any = None  # checked by accepted_fields.py, in Anthropic's words
    # tool search: left out of the prompt until a tool_reference loads it (conversion.py)
    defer_loading: Any = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # Anthropic: a tool's input is always an object
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError('input_schema must describe an object ("type": "object")')
        return schema


class AnthropicCountTokensRequest(OpenAIRequestModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a messages request."""

    model: str
    messages: list[AnthropicMessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Optional[Union[str, Blocks]] = None
    tools: Optional[list[AnthropicToolParam]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    # Accepted, no effect; their values are checked (accepted_fields.py). Any: one wording
    # for them and for the cache_control of blocks (plain JSON here).
    cache_control: Any = None
    metadata: Any = None
    service_tier: Any = None
    speed: Any = None
    inference_geo: Any = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``POST /v1/messages``. ``max_tokens`` (tokens, required, >= 1) is clamped to the
    room the prompt leaves in the context (llama.cpp's rule; Claude Code asks for 32000
    whatever the model). ``temperature`` is in [0, 1] (Anthropic's range)."""

    # Annotated alone: Int64's own bounds would override a Field(ge=1) given beside it
    max_tokens: Annotated[JSONInt, Field(ge=1, le=2**63 - 1)]  # JSONInt: true is not 1 token
    stop_sequences: Optional[Annotated[list[StopSequence], Field(max_length=MAX_STOP_STRINGS)]] = None
    stream: Optional[bool] = False
    temperature: Optional[JSONFloat] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[JSONFloat] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[Int64] = Field(default=None, ge=0)
    output_config: Optional[dict[str, Any]] = None  # format: structured outputs; effort: ignored
    # beta message threads: {"type": "create"} or {"type": "continue", "previous_message_id"}
    # (threads.py; checked there, so its errors name thread.<field>)
    thread: Any = None
    # beta compaction: {"type": "summarize", "instructions"?} (compaction.py)
    compaction: Any = None


# ----------------------------------------------------------------------------- responses
class TextBlock(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(OpenAIBaseModel):
    """The model's reasoning (``--reasoning-parser``). ``signature`` is empty: no
    signature can be verified across servers, and clients send it back unread."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class CompactionBlock(OpenAIBaseModel):
    """The summary a compaction request answers with (``compaction.py``); ``content``
    None: the model wrote none."""

    type: Literal["compaction"] = "compaction"
    content: Optional[str] = None


ContentBlock = Union[TextBlock, ThinkingBlock, ToolUseBlock, CompactionBlock]


class CacheCreation(OpenAIBaseModel):
    """Anthropic's ``usage.cache_creation``: the tokens written to the cache, by the
    ``ttl`` of the breakpoint that wrote them."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class AnthropicUsage(OpenAIBaseModel):
    """Token counts; ``input_tokens + cache_creation_input_tokens +
    cache_read_input_tokens`` is the prompt (``streaming.usage_of`` says which tokens go
    where: the prefix cache's reads and, for a request with ``cache_control``, its writes)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = Field(default_factory=CacheCreation)


class AnthropicMessagesResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(OpenAIBaseModel):
    input_tokens: int


# ----------------------------------------------------------------------------- errors
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (other 4xx: invalid_request_error,
    5xx: api_error)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


# String error codes that Anthropic's body carries as ``error.details.error_code`` (the
# message-threads beta; the ``anthropic`` SDK's thread state acts on them).
DETAILED_ERROR_CODES = frozenset({"thread_not_found", "thread_already_continued", "thread_continue_in_flight",
                                  "thread_unsupported_request", "tool_reference_unresolved"})


def anthropic_error_body(status: int, info: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's error body ``{"type": "error", "error": {"type", "message"}}`` of an
    OpenAI error object (the ErrorShape of ``/v1/messages``). Anthropic's body has no
    ``param``, so the message names the field when it does not already. An OpenAI
    ``code`` among :data:`DETAILED_ERROR_CODES` becomes ``error.details.error_code``."""
    message = str(info.get("message") or "")
    param = info.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    error: dict[str, Any] = {"type": anthropic_error_type(status), "message": message}
    if info.get("code") in DETAILED_ERROR_CODES:
        error["details"] = {"error_code": info["code"]}
    return {"type": "error", "error": error}
