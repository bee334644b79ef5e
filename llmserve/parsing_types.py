"""What the output parsers produce: parsed deltas (content, reasoning, tool-call fragments)
and finished tool calls (vLLM's ``DeltaMessage``, ``DeltaToolCall``, ``DeltaFunctionCall``,
``FunctionCall``, ``ToolCall``, ``ExtractedToolCallInformation``).

This is the low floor of the protocol-neutral output path: the tool parsers
(``llmserve/tool_parsers/``), the reasoning parsers (``llmserve/reasoning/``, which the
engine process loads for structured outputs) and every front door (OpenAI chat and
Responses, Anthropic Messages, Ollama) share these types, and each door maps them to its
own wire format. So this module imports nothing of ``llmserve.entrypoints`` or
``llmserve.engine`` (``tests/test_layering.py`` checks it); the chat protocol
(``entrypoints/openai/chat_completion/protocol.py``) re-exports the names under vLLM's
paths.

The types are pydantic models because the OpenAI chat objects embed them as they are
(``ChatMessage.tool_calls``, ``ChatCompletionResponseStreamChoice.delta``); the streamed
ones leave their None fields out of the JSON, as OpenAI's chunks do. Unknown fields are
kept (``extra="allow"``), as on every API model.
"""
from __future__ import annotations

import uuid
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator


def make_tool_call_id() -> str:
    """A new tool-call id in vLLM's form ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ParsedModel(BaseModel):
    """Base of the parsed-output types: unknown fields are allowed (and kept), as on the
    API models that embed them (``OpenAIBaseModel``)."""

    model_config = ConfigDict(extra="allow")


class _DropNone(ParsedModel):
    """A streamed fragment: fields that are None are left out of the JSON."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):  # noqa: ANN001
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(ParsedModel):
    """A complete function call: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(ParsedModel):
    """One tool call of an assistant message (vLLM's id form ``chatcmpl-tool-<hex>``)."""

    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_DropNone):
    """A streamed fragment of a function call (None fields are left out of the JSON)."""

    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_DropNone):
    """A streamed fragment of tool call ``index``: the first fragment of a call carries
    ``id``, ``type`` and ``function.name``; later ones only ``function.arguments``."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class ExtractedToolCallInformation(ParsedModel):
    """What a tool parser found in a whole output (vLLM's): whether tools were called,
    the calls, and the text that stays content (None when there is none)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: Optional[str] = None


class DeltaMessage(_DropNone):
    """A streamed message fragment: new content, reasoning and tool-call fragments;
    fields that are None are left out of the JSON. ``reasoning`` (vLLM's current name)
    is copied to ``reasoning_content`` (its former name, still read by many clients)."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_validator(mode="after")
    def _both_reasoning_names(self) -> "DeltaMessage":
        if self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self
