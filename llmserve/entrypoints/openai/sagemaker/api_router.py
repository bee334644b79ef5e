"""``POST /invocations`` (Amazon SageMaker's inference route; vLLM's
``entrypoints/sagemaker/routes.py``) and ``GET /ping`` (SageMaker's health check).

The body is a chat, completion or embeddings request, recognised by its shape
(``messages`` -> chat, ``prompt`` -> completions, ``input`` -> embeddings), validated
by that endpoint's request model and served by that endpoint's own route, so the answer
(stream or not, errors) is the same as on ``/v1/...``. Any other body is a 400.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from llmserve.entrypoints.openai.chat_completion.api_router import create_chat_completion
from llmserve.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.completion.api_router import create_completion
from llmserve.entrypoints.openai.completion.protocol import CompletionRequest
from llmserve.entrypoints.openai.embeddings.api_router import create_embedding
from llmserve.entrypoints.openai.embeddings.protocol import EmbeddingRequest
from llmserve.entrypoints.openai.basic.api_router import health
from llmserve.sampling_params import SamplingParamsError

router = APIRouter()

# (the body key that marks the kind, its request model, its route), checked in order.
INVOCATION_TYPES: tuple[tuple[str, type[BaseModel], Callable[[Any, Request], Awaitable[Response]]], ...] = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("input", EmbeddingRequest, create_embedding),
)


@router.post("/invocations")
async def invocations(raw_request: Request) -> Response:
    """Serve a SageMaker invocation like the endpoint its body's shape names.
    Raises SamplingParamsError (400) for a body that is not a JSON object of one of the
    three kinds; validation errors of the chosen model answer as on its endpoint."""
    try:
        body = json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SamplingParamsError(f"Invalid JSON in the request body: {e}", None) from e
    if isinstance(body, dict):
        for key, model, route in INVOCATION_TYPES:
            if key in body:
                try:
                    request = model.model_validate(body)
                except ValidationError as e:
                    raise RequestValidationError(e.errors(include_input=False)) from e
                return await route(request, raw_request)
    kinds = ", ".join(f"'{key}' ({model.__name__})" for key, model, _ in INVOCATION_TYPES)
    raise SamplingParamsError(f"/invocations takes a JSON object with one of: {kinds}.", None)


@router.get("/ping")
async def ping(raw_request: Request) -> Response:
    """SageMaker's health check: the same answer as ``GET /health``."""
    return await health(raw_request)


def register_sagemaker_api_routers(app: FastAPI) -> None:
    """Mount /invocations and /ping."""
    app.include_router(router)
