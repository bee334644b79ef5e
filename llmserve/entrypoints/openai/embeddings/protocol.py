"""Protocol of ``POST /v1/embeddings`` (OpenAI's, with vLLM's extra fields), of
``POST /pooling`` (vLLM's raw pooling output) and of llama-server's ``POST /embedding``."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Field

from llmserve.entrypoints.openai.common.limits import MAX_MESSAGES
from llmserve.entrypoints.openai.common.pooling import PoolingFields, PoolingInput
from llmserve.entrypoints.openai.common.protocol import Int64, JSONInt, OpenAIBaseModel, UsageInfo


class EmbeddingRequest(PoolingFields):
    """``input`` (string, strings, token ids or lists of token ids) or, as vLLM allows,
    ``messages`` rendered with the chat template (one prompt). encoding_format: "float"
    or "base64" (openai-python's default). dimensions: only for Matryoshka models."""

    # ``input`` (or ``messages``) is required, checked by the handler: named in the 400 of
    # a body that is empty or not an object (server_utils.required_fields)
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = ("input",)

    input: Optional[PoolingInput] = None
    messages: Optional[list[dict[str, Any]]] = Field(default=None, max_length=MAX_MESSAGES)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[JSONInt] = Field(default=None, ge=1)
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
    """``POST /pooling``: the embeddings request, plus vLLM's ``task`` (vLLM's
    ``PoolingCompletionRequest.task``, a ``PoolingTask``) and ``use_activation``. An
    embedding model: "encode" (the default: the raw pooled vector, normalised only when
    ``normalize`` says so) or "embed". A classification model: "classify" (the default,
    as vLLM's ``get_pooling_task``: the label probabilities, ``[num_labels]``) or
    "token_classify" (vLLM's per-token classification, ``LLM.reward``: ``[num_tokens,
    num_labels]``, the head on every token then softmax / sigmoid). use_activation=false:
    the head's raw logits."""

    task: Optional[Literal["encode", "embed", "classify", "token_classify"]] = None
    use_activation: Optional[bool] = None


class PoolingResponseData(OpenAIBaseModel):
    """``data``: the pooled vector, one row per token for token_classify, or base64 of
    its little-endian float32 values (row by row)."""

    index: int
    object: str = "pooling"
    data: Union[list[list[float]], list[float], str]


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class LlamaEmbeddingRequest(PoolingFields):
    """llama-server's ``POST /embedding`` (and ``/embeddings``): ``content`` (a string,
    strings, token ids or lists of token ids; required), or ``input``, which llama-server
    reads first (the name its ``/embeddings`` documents, as ``/v1/embeddings``), and ``embd_normalize`` (-1: none, 0: scaled so the
    largest magnitude is 32760, 1: taxicab, 2: Euclidean, the default, above 2: that
    p-norm), applied to the model's pooled vector before any normalisation of its own."""

    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = ("content",)

    content: Optional[PoolingInput] = None
    input: Optional[PoolingInput] = None
    embd_normalize: Int64 = 2
