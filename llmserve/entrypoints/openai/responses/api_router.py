"""``/v1/responses`` routes: create (``POST``), retrieve (``GET``), delete (``DELETE``)
and cancel (``POST .../cancel``), thin over OpenAIServingResponses."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.responses.protocol import DeletedResponse, ResponsesRequest, ResponsesResponse
from llmserve.entrypoints.openai.responses.serving import OpenAIServingResponses
from llmserve.entrypoints.openai.server_utils import json_response, request_id_of, result_response, \
    with_cancellation

router = APIRouter()


def responses(raw_request: Request) -> OpenAIServingResponses:
    return raw_request.app.state.openai_serving_responses


@router.post("/v1/responses")
async def create_responses(request: ResponsesRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, responses(raw_request).create_responses(request, request_id_of(raw_request))))


@router.get("/v1/responses/{response_id}", response_model=ResponsesResponse)
async def retrieve_responses(response_id: str, raw_request: Request) -> Response:
    return json_response(responses(raw_request).retrieve_responses(response_id))


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_responses(response_id: str, raw_request: Request) -> Response:
    return json_response(responses(raw_request).delete_responses(response_id))


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponsesResponse)
async def cancel_responses(response_id: str, raw_request: Request) -> Response:
    return json_response(await responses(raw_request).cancel_responses(response_id))


def register_responses_api_routers(app: FastAPI) -> None:
    """Mount /v1/responses and /v1/responses/{response_id}[/cancel]."""
    app.include_router(router)
