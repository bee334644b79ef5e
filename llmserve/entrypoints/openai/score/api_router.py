"""``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank`` and ``/v2/rerank``: thin routes
over OpenAIServingScores."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.score.protocol import RerankRequest, ScoreRequest
from llmserve.entrypoints.openai.score.serving import OpenAIServingScores
from llmserve.entrypoints.openai.server_utils import json_or_499

router = APIRouter()


def scores(raw_request: Request) -> OpenAIServingScores:
    return raw_request.app.state.openai_serving_scores


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, scores(raw_request).create_score(request))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/reranking")  # llama-server's aliases
@router.post("/v1/reranking")
async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, scores(raw_request).create_rerank(request))


def register_score_api_routers(app: FastAPI) -> None:
    """Mount the score and rerank routes."""
    app.include_router(router)
