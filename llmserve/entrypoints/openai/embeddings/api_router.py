"""``POST /v1/embeddings``, ``POST /pooling`` and llama-server's ``POST /embedding``: thin
routes over OpenAIServingEmbedding."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response

from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest, LlamaEmbeddingRequest, PoolingRequest
from llmserve.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from llmserve.entrypoints.openai.server_utils import json_or_499, with_cancellation

router = APIRouter()


def embedding(raw_request: Request) -> OpenAIServingEmbedding:
    return raw_request.app.state.openai_serving_embedding


@router.post("/v1/embeddings")
async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, embedding(raw_request).create_embedding(request))


@router.post("/pooling")
async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, embedding(raw_request).create_pooling(request))


@router.post("/embedding")
@router.post("/embeddings")  # llama-server's: the same answer as /embedding (not /v1/embeddings')
async def create_llama_embedding(request: LlamaEmbeddingRequest, raw_request: Request) -> Response:
    result = await with_cancellation(raw_request, embedding(raw_request).create_llama_embedding(request))
    return Response(status_code=499) if result is None else JSONResponse(result)


def register_embeddings_api_routers(app: FastAPI) -> None:
    """Mount /v1/embeddings, /pooling, /embedding and /embeddings."""
    app.include_router(router)
