"""``POST /v1/embeddings`` and ``POST /pooling``: thin routes over OpenAIServingEmbedding."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest, PoolingRequest
from llmserve.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from llmserve.entrypoints.openai.server_utils import json_or_499

router = APIRouter()


def embedding(raw_request: Request) -> OpenAIServingEmbedding:
    return raw_request.app.state.openai_serving_embedding


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, embedding(raw_request).create_embedding(request))


@router.post("/pooling")
async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, embedding(raw_request).create_pooling(request))


def register_embeddings_api_routers(app: FastAPI) -> None:
    """Mount /v1/embeddings and /pooling."""
    app.include_router(router)
