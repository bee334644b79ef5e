"""``/v1/responses`` routes: create (``POST``), retrieve (``GET``, and with
``?stream=true[&starting_after=N]`` the stored events again), the input items (``GET
.../input_items``), delete (``DELETE``) and cancel (``POST .../cancel``), and the
prompt's token count (``POST /v1/responses/input_tokens``), thin over
OpenAIServingResponses. ``POST /v1/responses/compact`` (OpenAI's server-side compaction,
the client's ``responses.compact``) is not served: a 404 that says so
(:func:`compact_not_supported`), not the 405 of ``/v1/responses/{response_id}``."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.responses.protocol import DeletedResponse, ResponsesInputTokens, \
    ResponsesInputTokensRequest, ResponsesRequest, ResponsesResponse
from llmserve.entrypoints.openai.responses.listing import DEFAULT_LIMIT, ResponseItemList
from llmserve.entrypoints.openai.responses.serving import DROPPED_TOOLS_HEADER, OpenAIServingResponses, \
    dropped_tools_header
from llmserve.entrypoints.openai.server_utils import json_response, request_id_of, result_response, \
    with_cancellation

router = APIRouter()


def responses(raw_request: Request) -> OpenAIServingResponses:
    return raw_request.app.state.openai_serving_responses


@router.post("/v1/responses")
async def create_responses(request: ResponsesRequest, raw_request: Request) -> Response:
    handler = responses(raw_request)
    response = result_response(await with_cancellation(
        raw_request, handler.create_responses(request, request_id_of(raw_request))))
    dropped = handler.dropped_tools(request)
    if dropped:  # --responses-unsupported-tools drop: say which tools the model never saw
        response.headers[DROPPED_TOOLS_HEADER] = dropped_tools_header(dropped)
    return response


@router.post("/v1/responses/input_tokens", response_model=ResponsesInputTokens)
async def count_input_tokens(request: ResponsesInputTokensRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(raw_request, responses(raw_request).count_input_tokens(request)))


@router.post("/v1/responses/compact", include_in_schema=False)
async def compact_not_supported() -> None:
    """OpenAI's compaction endpoint: 404 saying it is not served (its output is an
    encrypted item only OpenAI's models read)."""
    raise HTTPException(404, "POST /v1/responses/compact (server-side compaction) is not supported by this server; "
                             "compact the conversation on the client (summarise it with POST /v1/responses) or "
                             "use truncation: \"auto\".")


@router.get("/v1/responses/{response_id}", response_model=ResponsesResponse)
async def retrieve_responses(response_id: str, raw_request: Request, stream: bool = False,
                             starting_after: Optional[int] = None) -> Response:
    return result_response(responses(raw_request).retrieve_responses(response_id, stream, starting_after))


@router.get("/v1/responses/{response_id}/input_items", response_model=ResponseItemList)
async def list_input_items(response_id: str, raw_request: Request, after: Optional[str] = None,
                           limit: int = Query(DEFAULT_LIMIT), order: str = "desc") -> Response:
    return json_response(responses(raw_request).list_input_items(response_id, after, limit, order))


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse)
async def delete_responses(response_id: str, raw_request: Request) -> Response:
    return json_response(responses(raw_request).delete_responses(response_id))


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponsesResponse)
async def cancel_responses(response_id: str, raw_request: Request) -> Response:
    return json_response(await responses(raw_request).cancel_responses(response_id))


def register_responses_api_routers(app: FastAPI) -> None:
    """Mount /v1/responses and /v1/responses/{response_id}[/cancel]."""
    app.include_router(router)
