"""Protocol of ``/score`` and ``/v1/score`` (vLLM's) and ``/rerank``, ``/v1/rerank``,
``/v2/rerank`` (vLLM's Jina/Cohere-style rerank)."""
from __future__ import annotations

from typing import Any, Optional, Union

from llmserve.entrypoints.openai.common.pooling import PoolingFields
from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, UsageInfo


class ScoreRequest(PoolingFields):
    """``text_1`` against ``text_2``: one against each (1:N) or pairwise (N:N).
    use_activation (a cross-encoder only): false scores by the raw logit (vLLM's field)."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    use_activation: Optional[bool] = None


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(PoolingFields):
    """``query`` against ``documents`` (strings, or Cohere-style ``{"text": ...}``
    objects); ``top_n``: keep the best n (None or 0: all); ``return_documents``: include
    each document's text (default True, as vLLM); use_activation as ScoreRequest's."""

    query: str
    documents: list[Union[str, dict[str, Any]]]
    top_n: Optional[int] = None
    return_documents: bool = True
    use_activation: Optional[bool] = None


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
