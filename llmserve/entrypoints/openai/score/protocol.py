"""Protocol of ``/score`` and ``/v1/score`` (vLLM's) and ``/rerank``, ``/v1/rerank``,
``/v2/rerank`` (vLLM's Jina/Cohere-style rerank)."""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from llmserve.entrypoints.openai.common.limits import MAX_PROMPTS_PER_REQUEST
from llmserve.entrypoints.openai.common.pooling import ActivationFields, PoolingTexts
from llmserve.entrypoints.openai.common.protocol import JSONInt, OpenAIBaseModel, UsageInfo


#: The names a /score request may give its two sides, as vLLM's ``ScoreRequest`` union
#: (``entrypoints/pooling/scoring/protocol.py``: ScoreTextRequest, ScoreQueriesDocumentsRequest,
#: ScoreQueriesItemsRequest, ScoreDataRequest); a request uses exactly one pair.
SCORE_FIELD_NAMES: tuple[tuple[str, str], ...] = (("text_1", "text_2"), ("queries", "documents"),
                                                  ("queries", "items"), ("data_1", "data_2"))
_ScoreSide = Optional[Union[str, PoolingTexts]]


def _score_names_hint() -> str:
    names = [f"`{a}`/`{b}`" for a, b in SCORE_FIELD_NAMES]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _missing_side_message(given: str) -> str:
    """The 400 of a request that gives only ``given`` of a pair: every field that can go
    with it (``queries`` has two, ``documents`` and ``items``; a fresh-user trial got
    "`documents` is required with `queries`", which hid ``items``), then every pairing."""
    partners = [b if a == given else a for a, b in SCORE_FIELD_NAMES if given in (a, b)]
    options = " or ".join(f"`{p}`" for p in partners)
    return f"`{given}` needs the other side, {options}: name the two sides with one pair of {_score_names_hint()}."


class ScoreRequest(ActivationFields):
    """The first side against the second: one against each (1:N) or pairwise (N:N), at
    most ``MAX_PROMPTS_PER_REQUEST`` texts a side. The sides are named as in any of vLLM's
    ``ScoreRequest`` forms, ``text_1``/``text_2``, ``queries``/``documents``,
    ``queries``/``items`` or ``data_1``/``data_2`` (``SCORE_FIELD_NAMES``); a request that
    mixes two namings or lacks one side is a 400 naming the field. ``data_1``/``data_2``
    and ``field_names`` give the sides and their names whichever were used.
    use_activation (a cross-encoder only): false scores by the raw logit (vLLM's field)."""

    text_1: _ScoreSide = None
    text_2: _ScoreSide = None
    queries: _ScoreSide = None
    documents: _ScoreSide = None
    items: _ScoreSide = None
    data_1: _ScoreSide = None
    data_2: _ScoreSide = None
    _names: tuple[str, str] = PrivateAttr(default=("text_1", "text_2"))

    @model_validator(mode="after")
    def _one_naming(self) -> "ScoreRequest":
        given = [n for n in dict.fromkeys(x for pair in SCORE_FIELD_NAMES for x in pair) if getattr(self, n) is not None]
        # the naming with most of its fields given (the first of a tie), then anything else is a mix
        pair = max(SCORE_FIELD_NAMES, key=lambda p: sum(n in given for n in p))
        if not given:
            raise PydanticCustomError("missing", f"Give the two sides to score: {_score_names_hint()}.",
                                      {"param": "text_1"})
        for name in given:
            if name not in pair:
                raise PydanticCustomError(
                    "score_fields", f"`{name}` cannot be used with `{pair[0]}`/`{pair[1]}`: name the two sides "
                    f"with one pair of {_score_names_hint()}.", {"param": name})
        for name in pair:
            if name not in given:
                other = pair[1] if name == pair[0] else pair[0]
                raise PydanticCustomError("missing", _missing_side_message(other), {"param": name})
        self._names = pair
        if pair != ("data_1", "data_2"):
            self.data_1, self.data_2 = getattr(self, pair[0]), getattr(self, pair[1])
        return self

    @property
    def field_names(self) -> tuple[str, str]:
        """The request's names of the two sides (for errors naming them)."""
        return self._names


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
    top_n: Optional[JSONInt] = None
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
