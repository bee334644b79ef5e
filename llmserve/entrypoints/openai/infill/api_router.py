"""``POST /infill`` (llama-server's route): a thin route over infill/serving.py, on the
completion handler of the model the request names."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.infill.protocol import InfillRequest
from llmserve.entrypoints.openai.infill.serving import create_infill
from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation

router = APIRouter()


def completion_handler(raw_request: Request, request: InfillRequest):
    handler = raw_request.app.state.openai_serving_completion
    pick = getattr(handler, "handler_for", None)  # several models: the one `model` names
    return pick(request) if pick is not None else handler


@router.post("/infill")
async def infill(request: InfillRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, create_infill(completion_handler(raw_request, request), request, request_id_of(raw_request))))


def register_infill_api_routers(app: FastAPI) -> None:
    """Mount /infill."""
    app.include_router(router)
