"""``GET /v1/models`` and ``GET /v1/models/{model_id}``."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.server_utils import json_response

router = APIRouter()


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> Response:
    return json_response(raw_request.app.state.openai_serving_models.show_available_models())


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw_request: Request) -> Response:
    """One model's card (OpenAI's "retrieve model"); 404 NotFoundError for an unknown id.
    ``:path`` keeps ids with a slash (``org/name``) in one parameter."""
    return json_response(raw_request.app.state.openai_serving_models.show_model(model_id))


def register_models_api_routers(app: FastAPI) -> None:
    """Mount /v1/models and /v1/models/{model_id}."""
    app.include_router(router)
