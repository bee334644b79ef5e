"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: thin routes over
AnthropicServingMessages. Claude Code's ``?beta=true`` query and the ``anthropic-version``
/ ``anthropic-beta`` headers are tolerated (nothing they switch on changes what a local
model can do); errors take Anthropic's body through the ErrorShape registered in
``api_server.ERROR_SHAPES`` (:data:`ANTHROPIC_ERROR_SHAPE`).

The Message Batches API (``/v1/messages/batches`` and every path under it, any method)
is not served: it answers Anthropic's 404 ``not_found_error`` saying so
(:func:`batches_not_supported`), so the SDK's ``client.messages.batches`` calls raise a
NotFoundError that tells why, not a bare "Not Found"."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from starlette.responses import Response

from llmserve.entrypoints.anthropic.conversion import to_chat_request
from llmserve.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    anthropic_error_body,
)
from llmserve.entrypoints.anthropic.serving import AnthropicServingMessages
from llmserve.entrypoints.anthropic.threads import MessageThreadStore, with_thread_history
from llmserve.entrypoints.openai.admission_precheck import check_model
from llmserve.entrypoints.openai.error_shapes import ErrorShape
from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
BATCHES_PATH = "/v1/messages/batches"
BATCHES_METHODS = ["GET", "POST", "DELETE"]  # list, create / cancel, delete (the SDK's calls)
# Anthropic's request-id header on every response and request_id in error bodies (its SDKs'
# message._request_id and APIStatusError.request_id)
# On the shared routes (/v1/models...), a request with the anthropic-version header (every
# Anthropic SDK call, Claude Code's too) gets Anthropic's body as well.
ANTHROPIC_ERROR_SHAPE = ErrorShape(prefixes=("/v1/messages",), shape=anthropic_error_body,
                                   request_id_header="request-id", request_id_field="request_id",
                                   client_header="anthropic-version")

router = APIRouter()


def messages(raw_request: Request) -> AnthropicServingMessages:
    state = raw_request.app.state
    return AnthropicServingMessages(state.openai_serving_chat, getattr(state, "anthropic_threads", None))


@router.post("/v1/messages")
async def create_message(request: AnthropicMessagesRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, messages(raw_request).create_message(request, request_id_of(raw_request))))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: AnthropicCountTokensRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(raw_request, messages(raw_request).count_tokens(request)))


async def batches_not_supported() -> None:
    """Every Message Batches call: 404 in Anthropic's body (the ErrorShape reshapes it)."""
    raise HTTPException(404, "The Message Batches API (/v1/messages/batches) is not supported by this server; "
                             "send each request to POST /v1/messages instead.")


for _path in (BATCHES_PATH, BATCHES_PATH + "/{rest:path}"):
    router.add_api_route(_path, batches_not_supported, methods=BATCHES_METHODS, include_in_schema=False)


def _check_messages(state: Any, request: AnthropicMessagesRequest) -> None:
    """The checks ``/v1/messages`` runs before it renders (the mapping, Anthropic's rules,
    the model it names, the chat request's own): admission runs them on a request it
    would refuse (a thread's continue with the conversation it continues)."""
    request = with_thread_history(request, getattr(state, "anthropic_threads", None))
    chat_request = to_chat_request(request, auto_tools=False)
    check_model(state, "openai_serving_chat", chat_request)
    chat_request.check()


async def _fits_messages(state: Any, request: AnthropicMessagesRequest) -> None:
    """The prompt ``/v1/messages`` would render, against the context, as the route holds
    it (``max_tokens`` is clamped to the room; no room at all is its "prompt is too long"
    400): run on a request admission would refuse, so that 400 comes before the 429."""
    serving = AnthropicServingMessages(state.openai_serving_chat, getattr(state, "anthropic_threads", None))
    await serving._clamped(with_thread_history(request, getattr(state, "anthropic_threads", None)))


# Body model -> its first checks (admission_precheck.Prechecks.by_model), and its
# context-length check (Prechecks.fits)
ANTHROPIC_MODEL_CHECKS = {AnthropicMessagesRequest: _check_messages}
ANTHROPIC_FIT_CHECKS = {AnthropicMessagesRequest: _fits_messages}


def register_anthropic_api_routers(app: FastAPI) -> None:
    """Mount /v1/messages and /v1/messages/count_tokens, with the store of message
    threads (``app.state.anthropic_threads``)."""
    app.state.anthropic_threads = MessageThreadStore()
    app.include_router(router)
