"""``POST /v1/responses`` (not served yet: 404 for an unknown model, else 400)."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.responses.protocol import ResponsesRequest
from llmserve.entrypoints.openai.responses.serving import OpenAIServingResponses

router = APIRouter()


def responses(raw_request: Request) -> OpenAIServingResponses:
    return raw_request.app.state.openai_serving_responses


@router.post("/v1/responses")
async def create_responses(request: ResponsesRequest, raw_request: Request) -> Response:
    await responses(raw_request).create_responses(request)
    raise AssertionError("create_responses always raises")  # pragma: no cover


def register_responses_api_routers(app: FastAPI) -> None:
    """Mount /v1/responses."""
    app.include_router(router)
