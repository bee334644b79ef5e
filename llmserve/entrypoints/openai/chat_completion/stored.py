"""OpenAI's stored chat completions (``store: true``), which this server does not keep.

OpenAI's SDKs call ``GET /v1/chat/completions`` (``chat.completions.list``), ``GET``,
``POST`` and ``DELETE /v1/chat/completions/{completion_id}`` (``retrieve``, ``update``,
``delete``) and ``GET /v1/chat/completions/{completion_id}/messages``
(``messages.list``). vLLM keeps no chat completions and has none of these routes, so
the SDK met Starlette's bare 404 on some and a 405 ("GET is not allowed", since only
``POST /v1/chat/completions`` exists) on the list. Here every one of them, whatever the
id, answers the same 404 in OpenAI's error body saying why: nothing is ever stored (the
request's ``store`` is accepted and ignored, as in vLLM). The id is not echoed back.
"""
from __future__ import annotations

from fastapi import APIRouter, FastAPI

from llmserve.entrypoints.openai.common.errors import NotFoundError

router = APIRouter()

STORED_CHAT_COMPLETIONS_MESSAGE = (
    "Stored chat completions are not available: this server does not keep chat completions "
    "(a request's `store` is accepted and ignored, as in vLLM), so there are none to list, retrieve, "
    "update or delete. Keep the completion on the client, or use /v1/responses, which stores responses.")


def stored_chat_completions_not_kept() -> None:
    """Raise the one 404 (OpenAI's NotFoundError body) of every stored-chat-completion route."""
    raise NotFoundError(STORED_CHAT_COMPLETIONS_MESSAGE)


@router.get("/v1/chat/completions", include_in_schema=False)
async def list_chat_completions() -> None:
    stored_chat_completions_not_kept()


@router.get("/v1/chat/completions/{completion_id}", include_in_schema=False)
@router.post("/v1/chat/completions/{completion_id}", include_in_schema=False)
@router.delete("/v1/chat/completions/{completion_id}", include_in_schema=False)
async def stored_chat_completion(completion_id: str) -> None:
    stored_chat_completions_not_kept()


@router.get("/v1/chat/completions/{completion_id}/messages", include_in_schema=False)
async def list_chat_completion_messages(completion_id: str) -> None:
    stored_chat_completions_not_kept()


def register_stored_chat_api_routers(app: FastAPI) -> None:
    """Mount the stored-chat-completion routes (after ``/v1/chat/completions/render``,
    so that ``POST .../render`` stays the renderer's)."""
    app.include_router(router)
