"""``POST /v1/embeddings`` (a generative model answers 400)."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from llmserve.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding

router = APIRouter()


def embedding(raw_request: Request) -> OpenAIServingEmbedding:
    return raw_request.app.state.openai_serving_embedding


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    await embedding(raw_request).create_embedding(request)
    raise AssertionError("create_embedding always raises")  # pragma: no cover


def register_embeddings_api_routers(app: FastAPI) -> None:
    """Mount /v1/embeddings."""
    app.include_router(router)
