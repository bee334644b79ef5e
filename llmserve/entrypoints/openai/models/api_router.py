"""``GET /v1/models`` and ``GET /v1/models/{model_id}``."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response

from llmserve.entrypoints.openai.models.serving import ModelNotFoundError
from llmserve.entrypoints.openai.server_utils import json_response
from llmserve.entrypoints.openai.tenant_quotas import callable_models
from llmserve.entrypoints.openai.tenants import tenant_of, tenant_sees_model

router = APIRouter()


@router.get("/v1/models")
@router.get("/models")  # llama-server's alias
async def show_available_models(raw_request: Request) -> Response:
    """The served models and adapters the caller's key may call (a tenant's
    ``allowed_models`` hides the others, as their requests answer 404)."""
    models = raw_request.app.state.openai_serving_models.show_available_models()
    models.data = [card for card in models.data if tenant_sees_model(raw_request, card.id)]
    return json_response(models)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw_request: Request) -> Response:
    """One model's card (OpenAI's "retrieve model"); 404 NotFoundError for an unknown id.
    ``:path`` keeps ids with a slash (``org/name``) in one parameter. A model outside the
    tenant's ``allowed_models`` answers the same 404 as an unknown one."""
    if not tenant_sees_model(raw_request, model_id):
        raise ModelNotFoundError(model_id, callable_models(tenant_of(raw_request), raw_request.app.state))
    return json_response(raw_request.app.state.openai_serving_models.show_model(model_id))


def register_models_api_routers(app: FastAPI) -> None:
    """Mount /v1/models and /v1/models/{model_id}."""
    app.include_router(router)
