"""``POST /classify`` and ``POST /v1/classify``: thin routes over OpenAIServingClassification."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.classify.protocol import ClassificationRequest
from llmserve.entrypoints.openai.classify.serving import OpenAIServingClassification
from llmserve.entrypoints.openai.server_utils import json_or_499

router = APIRouter()


def classification(raw_request: Request) -> OpenAIServingClassification:
    return raw_request.app.state.openai_serving_classification


@router.post("/classify")
@router.post("/v1/classify")
async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
    return await json_or_499(raw_request, classification(raw_request).create_classify(request))


def register_classify_api_routers(app: FastAPI) -> None:
    """Mount /classify and /v1/classify."""
    app.include_router(router)
