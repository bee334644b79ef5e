"""``GET /v1/models``."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.server_utils import json_response

router = APIRouter()


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> Response:
    return json_response(raw_request.app.state.openai_serving_models.show_available_models())


def register_models_api_routers(app: FastAPI) -> None:
    """Mount /v1/models."""
    app.include_router(router)
