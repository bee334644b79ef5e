"""``POST /v1/chat/completions``: a thin route over OpenAIServingChat."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation

router = APIRouter()


def chat(raw_request: Request) -> OpenAIServingChat:
    return raw_request.app.state.openai_serving_chat


@router.post("/v1/chat/completions")
@router.post("/chat/completions")  # llama-server's alias
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, chat(raw_request).create_chat_completion(request, request_id_of(raw_request))))


def register_chat_api_routers(app: FastAPI) -> None:
    """Mount /v1/chat/completions (and llama-server's /chat/completions)."""
    app.include_router(router)
