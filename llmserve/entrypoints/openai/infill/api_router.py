"""llama-server's native routes, ``POST /infill`` and ``POST /completion`` (and its
``/completions`` alias): thin routes over infill/serving.py, on the completion handler of
the model the request names."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, Response

from llmserve.entrypoints.openai.infill.protocol import InfillRequest, LlamaCompletionRequest, LlamaSamplingRequest
from llmserve.entrypoints.openai.infill.serving import create_infill, create_llama_completion
from llmserve.entrypoints.openai.server_utils import request_id_of, result_response, with_cancellation

router = APIRouter()


def completion_handler(raw_request: Request, request: LlamaSamplingRequest):
    handler = raw_request.app.state.openai_serving_completion
    pick = getattr(handler, "handler_for", None)  # several models: the one `model` names
    return pick(request) if pick is not None else handler


@router.post("/infill")
async def infill(request: InfillRequest, raw_request: Request) -> Response:
    return result_response(await with_cancellation(
        raw_request, create_infill(completion_handler(raw_request, request), request, request_id_of(raw_request))))


@router.post("/completion")
@router.post("/completions")
async def llama_completion(request: LlamaCompletionRequest, raw_request: Request) -> Response:
    result = await with_cancellation(raw_request, create_llama_completion(
        completion_handler(raw_request, request), request, request_id_of(raw_request)))
    if isinstance(result, list):  # several prompts: llama-server's array of answers
        return JSONResponse([r.model_dump(mode="json") for r in result])
    return result_response(result)


def register_infill_api_routers(app: FastAPI) -> None:
    """Mount /infill, /completion and /completions."""
    app.include_router(router)
