"""Protocol of ``/score`` and ``/v1/score`` (vLLM's) and ``/rerank``, ``/v1/rerank``,
``/v2/rerank`` (vLLM's Jina/Cohere-style rerank)."""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import Field

from llmserve.entrypoints.openai.common.limits import MAX_PROMPTS_PER_REQUEST
from llmserve.entrypoints.openai.common.pooling import ActivationFields, PoolingTexts
from llmserve.entrypoints.openai.common.protocol import OpenAIBaseModel, UsageInfo


class ScoreRequest(ActivationFields):
    """``text_1`` against ``text_2``: one against each (1:N) or pairwise (N:N), at most
    ``MAX_PROMPTS_PER_REQUEST`` texts a side. use_activation (a cross-encoder only): false
    scores by the raw logit (vLLM's field)."""

    text_1: Union[str, PoolingTexts]
    text_2: Union[str, PoolingTexts]


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


class RerankRequest(ActivationFields):
    """``query`` against ``documents`` (strings, or Cohere-style ``{"text": ...}``
    objects; at most ``MAX_PROMPTS_PER_REQUEST``); ``top_n``: keep the best n (None or 0:
    all); ``return_documents``: include each document's text (default True, as vLLM);
    use_activation as ScoreRequest's."""

    query: str
    documents: Annotated[list[Union[str, dict[str, Any]]], Field(max_length=MAX_PROMPTS_PER_REQUEST)]
    top_n: Optional[int] = None
    return_documents: bool = True


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
