"""``POST /tokenize`` and ``POST /detokenize``: thin routes over OpenAIServingTokenization."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.server_utils import json_response
from llmserve.entrypoints.openai.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from llmserve.entrypoints.openai.tokenize.serving import OpenAIServingTokenization

router = APIRouter()


def tokenization(raw_request: Request) -> OpenAIServingTokenization:
    return raw_request.app.state.openai_serving_tokenization


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    return json_response(await tokenization(raw_request).create_tokenize(request))


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return json_response(await tokenization(raw_request).create_detokenize(request))


def register_tokenize_api_routers(app: FastAPI) -> None:
    """Mount /tokenize and /detokenize."""
    app.include_router(router)
