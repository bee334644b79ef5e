"""Protocol of ``POST /v1/embeddings`` (OpenAI's, with vLLM's extra fields) and of
``POST /pooling`` (vLLM's raw pooling output)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES
from llmserve.entrypoints.openai.common.pooling import PoolingFields, PoolingInput
from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, UsageInfo


class EmbeddingRequest(PoolingFields):
    """``input`` (string, strings, token ids or lists of token ids) or, as vLLM allows,
    ``messages`` rendered with the chat template (one prompt). encoding_format: "float"
    or "base64" (openai-python's default). dimensions: only for Matryoshka models."""

    input: Optional[PoolingInput] = None
    messages: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_MESSAGES)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling``: the embeddings request, plus vLLM's ``task`` ("encode": the raw
    pooled vector, normalised only when ``normalize`` says so; "embed")."""

    task: Optional[Literal["encode", "embed"]] = None


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: Union[list[float], str]


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo
