"""``POST /v1/completions``: a thin route over OpenAIServingCompletion."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
from llmserve.entrypoints.openai.completion.serving import OpenAIServingCompletion
from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation

router = APIRouter()


def completion(raw_request: Request) -> OpenAIServingCompletion:
    return raw_request.app.state.openai_serving_completion


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, completion(raw_request).create_completion(request, request_id_of(raw_request))))


def register_completion_api_routers(app: FastAPI) -> None:
    """Mount /v1/completions."""
    app.include_router(router)
